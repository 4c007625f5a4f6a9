"""`SessionSettings`: how one ORT session runs, one value from the module down to `assemble`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SessionSettings"]


@dataclass(frozen=True)
class SessionSettings:
    """How one ORT session runs; a rebuild is ``dataclasses.replace(settings, ...)``.

    Attributes:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        spinning: whether ORT's worker threads spin between steps.
        intra_op_threads: the size of ORT's intra-op pool; 0 for ORT's default.
        evaluation: whether ORT's Module holds the eval graph.
        custom_op_library: a shared library of custom operators to register, or None.
    """

    device: str = "cpu"
    spinning: bool = True
    intra_op_threads: int = 0
    evaluation: bool = True
    custom_op_library: str | None = None
