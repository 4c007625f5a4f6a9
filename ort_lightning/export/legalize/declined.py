"""What a rewrite returns when it leaves its node to ORT: `Declined`, with the reason.

As onnxscript's rewriter answers a failed match with ``MatchResult.fail("reason")`` rather than
None, a rewrite of `engine.RULES` returns either the nodes that replace its node or a `Declined`
saying why it did not (the node needs no change, or a size it needs is unknown). The engine
collects them, and logs each as ``rule, node, reason`` on the logger ``ort_lightning.export.legalize``
at DEBUG level.

Example::

    >>> result = Declined("constant mode: ORT 1.19.2 differentiates it")
    >>> bool(result), result.reason
    (False, 'constant mode: ORT 1.19.2 differentiates it')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import onnx

__all__ = ["Declined", "Replacement"]


@dataclass(frozen=True)
class Declined:
    """A rewrite that leaves its node as it is, and why; falsy, as there is nothing to splice in."""

    reason: str

    def __bool__(self) -> bool:
        return False


#: What a rewrite returns: the nodes that replace its node, or why it leaves the node alone.
Replacement: TypeAlias = list[onnx.NodeProto] | Declined
