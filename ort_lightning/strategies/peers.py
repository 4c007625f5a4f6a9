"""A rank that died, told by its peers in one line instead of torch's hundred-line traceback.

`lost_rank` turns a collective that failed on a dead peer into a `DistributedError` naming the
rank, where it was noticed and what to do; ``ORT_LIGHTNING_TRACEBACK=1`` shows the whole chain.

Example::

    >>> error = lost_rank(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:27010."),
    ...                   rank=0, world_size=2, where="the gradient all-reduce at global_step=3")
    >>> print(str(error).split(";")[0])  # doctest: +NORMALIZE_WHITESPACE
    Rank 1 of 2 is gone: rank 0 lost its connection to it in the gradient all-reduce at global_step=3
    (Connection closed by peer)
"""

from __future__ import annotations

import logging
import os
import re
import sys
from types import TracebackType

from ort_lightning.errors import DistributedError

__all__ = ["TRACEBACK_VARIABLE", "lost_rank", "one_line_tracebacks"]

#: Environment variable that brings back the whole traceback of a `DistributedError`.
TRACEBACK_VARIABLE = "ORT_LIGHTNING_TRACEBACK"
_log = logging.getLogger(__name__)
#: What gloo and NCCL say when the other end of a collective is gone or never answers.
_LOST = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|Read error|Write error|communicator was aborted|"
    r"Timed out|timed out|Socket Timeout|NCCL error.*remote process exited",
)
_installed = False


def lost_rank(error: BaseException, *, rank: int, world_size: int, where: str) -> DistributedError | None:
    """The `DistributedError` for a collective that failed because a peer rank is gone, else None."""
    cause = " ".join(str(error).split())
    found = _LOST.search(cause)
    if found is None:
        return None
    _log.debug("rank %d: a collective failed because a peer is gone", rank, exc_info=error)
    others = [other for other in range(world_size) if other != rank]
    gone = f"Rank {others[0]} of {world_size} is" if len(others) == 1 else f"One of ranks {others} is"
    noticed = "waited in vain for it" if "imed out" in found.group(0) else "lost its connection to it"
    return DistributedError(
        f"{gone} gone: rank {rank} {noticed} in {where} ({found.group(0)}); its process ended or hangs "
        "(killed, out of memory, or its machine lost), so this rank stops too. Look at that rank's own output "
        "for why it ended, then start the run again from its last checkpoint (Trainer.fit(..., ckpt_path=...)); "
        f"{TRACEBACK_VARIABLE}=1 shows torch's whole traceback."
    )


def one_line_tracebacks() -> None:
    """Print an uncaught `DistributedError` as one line on stderr; hand any other to torch's own hook."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        if isinstance(error, DistributedError) and not os.environ.get(TRACEBACK_VARIABLE):
            print(f"{kind.__name__}: {' '.join(str(error).split())}", file=sys.stderr, flush=True)
            return
        previous(kind, error, trace)

    sys.excepthook = hook
    _installed = True
