"""`SessionSettings`: how one ORT session runs, as one value from the module down to `assemble`.

A session is built from its graphs, a start (a checkpoint file, or the running session's state)
and these settings. They travel whole: the module makes them, the running session keeps them
(`ort_lightning.ort.session.TrainingSession.settings`), and a rebuild asks for other ones with
``dataclasses.replace``, named field by named field.

Example::

    >>> import dataclasses
    >>> settings = SessionSettings(device="cpu", intra_op_threads=2)
    >>> dataclasses.replace(settings, spinning=False)
    SessionSettings(device='cpu', spinning=False, intra_op_threads=2, evaluation=True, custom_op_library=None)
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SessionSettings"]


@dataclass(frozen=True)
class SessionSettings:
    """How one ORT session runs; a rebuild is ``dataclasses.replace(settings, ...)``.

    Attributes:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (a built session holds ``"cpu"`` or ``"cuda:N"``).
        spinning: whether ORT's worker threads spin between steps.
        intra_op_threads: the size of ORT's intra-op pool; 0 for ORT's default.
        evaluation: whether ORT's Module holds the eval graph (False: training alone, one session fewer).
        custom_op_library: a shared library of custom operators to register with ONNX Runtime, or None.
    """

    device: str = "cpu"
    spinning: bool = True
    intra_op_threads: int = 0
    evaluation: bool = True
    custom_op_library: str | None = None
