"""How many cores a fit may use, and whether the user already chose torch's thread count."""

from __future__ import annotations

import os

import torch

from ort_lightning.errors import ConfigurationError

__all__ = ["THREAD_MODES", "available_cores", "check_threads", "user_torch_threads"]

#: What ``ORTLightningModule(threads=...)`` takes.
THREAD_MODES = ("auto", "off", "single")

#: Environment variables through which a user sizes torch's OpenMP/MKL pools.
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

# NOTE: torch exposes no "default" thread count; the count when this package is imported is
# the reference, so that a torch.set_num_threads(n) called later is seen as the user's choice.
_TORCH_DEFAULT_THREADS = torch.get_num_threads()


def check_threads(threads: object) -> None:
    """Refuse a `threads` option other than ``"auto"``, ``"off"`` or ``"single"`` (`ConfigurationError`)."""
    if threads not in THREAD_MODES:
        raise ConfigurationError(
            f"Expected argument `threads` to be one of {THREAD_MODES}, but got {threads!r}; pass \"auto\" (the "
            'default: ORT\'s and torch\'s thread pools share the cores), "off" (leave both pools as they are) or '
            '"single" (ORT on one thread that does not spin: many small fits in one process, as a fleet worker runs).'
        )


def available_cores() -> int:
    """The number of cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without sched_getaffinity
        return os.cpu_count() or 1


def user_torch_threads() -> tuple[bool, str]:
    """Whether the user chose torch's thread count, and why the answer is what it is."""
    for name in _THREAD_VARIABLES:
        if os.environ.get(name):
            return True, f"{name}={os.environ[name]} is set"
    current = torch.get_num_threads()
    if current != _TORCH_DEFAULT_THREADS:
        return True, f"torch.set_num_threads({current}) was called (torch's default here: {_TORCH_DEFAULT_THREADS})"
    return False, f"torch runs its default {current} thread(s)"
