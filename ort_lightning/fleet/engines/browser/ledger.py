"""What became of every reply that reached a browser fleet's server: used in its round, refused, or dropped.

Used: handed to the strategy; refused: it failed a check (its device is dropped), or it says its device
could not answer a SecAgg+ stage (its device stays); dropped: it answers a message no longer owed.
Nothing else can happen to a reply. The last `remember` closed messages keep their round, so that a
late reply is told which round it missed. A `Refusal` is a device that failed a round, and why.

Example::

    >>> ledger = Ledger()
    >>> ledger.accepted("m1", Receipt(1, "laptop", 0, "used"))
    >>> ledger.collected("m1"); ledger.closed("m1", 1)
    >>> [(r.server_round, r.device, r.outcome) for r in ledger.receipts], ledger.round_of("m1")
    ([(1, 'laptop', 'used')], 1)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["OUTCOMES", "Ledger", "Receipt", "Refusal"]

#: What becomes of a reply (see the module docstring).
OUTCOMES = ("used", "refused", "dropped")


@dataclass(frozen=True)
class Receipt:
    """One reply that reached the server: its round, its device (and partition), and what became of it."""

    server_round: int
    device: str
    partition: int
    outcome: str
    reason: str = ""


class Ledger:
    """Receipts as they are settled (a used one when collected) and the rounds of recently closed messages.

    Not thread-safe: the hub calls it under its lock.

    Args:
        remember: how many closed message ids to keep (older ones are forgotten, so memory stays flat).
    """

    def __init__(self, remember: int = 4096) -> None:
        self.receipts: list[Receipt] = []
        self._pending: dict[str, Receipt] = {}
        self._closed: OrderedDict[str, int] = OrderedDict()
        self._remember = remember

    def record(self, receipt: Receipt) -> None:
        """A reply that was refused or dropped."""
        self.receipts.append(receipt)

    def accepted(self, message_id: str, receipt: Receipt) -> None:
        """A reply that passed its checks; it is used once collected."""
        self._pending[message_id] = receipt

    def collected(self, message_id: str) -> None:
        """The reply to `message_id` went to the strategy (an error reply has no receipt)."""
        receipt = self._pending.pop(message_id, None)
        if receipt is not None:
            self.receipts.append(receipt)

    def closed(self, message_id: str, server_round: int) -> None:
        """`message_id` is owed no more; a reply to it from now on is dropped."""
        self._closed[message_id] = server_round
        self._closed.move_to_end(message_id)
        while len(self._closed) > self._remember:
            self._closed.popitem(last=False)

    def round_of(self, message_id: object) -> int | None:
        """The round of a closed message, or None when the fleet never sent it (or has forgotten it)."""
        return self._closed.get(message_id) if isinstance(message_id, str) else None


@dataclass(frozen=True)
class Refusal:
    """A device that failed a round: what it was, which round, and why."""

    device: str
    server_round: int
    reason: str
