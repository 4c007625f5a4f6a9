"""Who the devices of a browser fleet are: identities, partitions, and who joined, left and came back.

An identity seen before comes back as the same device (name, node id and, while free, partition); a new
one takes the lowest free partition, preferring one no absent device held. No lock: the hub holds its own.

Example::

    >>> population = Population(partitions=2)
    >>> population.admit("a1b2c3d4e5", "laptop", connected={}).member.partition
    0
    >>> again = population.admit("a1b2c3d4e5", "reloaded", connected={})
    >>> again.member.name, again.came_back
    ('laptop', True)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["IDENTITY", "Admission", "Member", "Population", "PopulationEvent"]

#: What a device identity looks like: 8 to 64 letters, digits, '-' or '_' (a page makes 32 hex digits).
IDENTITY = re.compile(r"[A-Za-z0-9_-]{8,64}")


@dataclass
class Member:
    """A device the fleet has admitted once: its name, its data partition and its Flower node id."""

    name: str
    partition: int
    node_id: int


@dataclass(frozen=True)
class Admission:
    """The decision on a page that is ready: the member it is (None when refused), or why it is refused."""

    member: Member | None
    reason: str | None = None
    came_back: bool = False


@dataclass(frozen=True)
class PopulationEvent:
    """A device that joined, came back, left, was dropped or was refused, in (or after) `server_round`."""

    server_round: int
    device: str
    kind: str
    detail: str = ""
    address: str = ""

    def describe(self) -> str:
        """The event's one line, e.g. ``round 2: tab-3 came back from 10.0.0.7:5123 (partition 1 of 3)``."""
        where = f" from {self.address}" if self.address else ""
        if not self.detail:
            return f"round {self.server_round}: {self.device} {self.kind}{where}"
        said = self.detail.removeprefix(f"{self.device} ")
        tail = f" ({said})" if self.kind in ("joined", "came back") else f": {said}"
        return f"round {self.server_round}: {self.device} {self.kind}{where}{tail}"


class Population:
    """The identities a fleet has admitted and their partitions (see the module docstring).

    Args:
        partitions: the most devices connected at once (each holds one partition of the data).
    """

    def __init__(self, partitions: int) -> None:
        self.partitions = partitions
        self._members: dict[str, Member] = {}
        self._nodes = 0

    def admit(self, identity: object, name: str, *, connected: Mapping[str, str]) -> Admission:
        """Admit the page `name` that sent `identity`; `connected` maps each connected device's identity to its name."""
        if not isinstance(identity, str) or not IDENTITY.fullmatch(identity):
            return Admission(None, f"{name} sent the device identity {str(identity)[:80]!r}, but an identity is 8 to "
                                   "64 letters, digits, '-' or '_', which the fleet's page keeps in the browser's "
                                   "storage; open the fleet's URL with its page (it makes one)")
        if identity in connected:
            return Admission(None, f"{name} claims the identity of {connected[identity]}, which is connected: one "
                                   "identity is one device; open the fleet's URL in another browser (or a private "
                                   "window) for another device")
        taken = {self._members[other].partition for other in connected if other in self._members}
        member = self._members.get(identity)
        if member is not None and member.partition not in taken:
            return Admission(member, came_back=True)
        partition = self._free(taken)
        if partition is None:
            return Admission(None, f"{name} found the fleet full: {self.partitions} devices are connected, its most; "
                                   "try again when one leaves, or start the fleet with more devices")
        if member is not None:
            member.partition = partition
            return Admission(member, came_back=True)
        self._nodes += 1
        member = Member(name, partition, self._nodes)
        self._members[identity] = member
        return Admission(member)

    def _free(self, taken: set[int]) -> int | None:
        """The lowest partition no connected device holds, one that no absent device held first; None if none."""
        free = [p for p in range(self.partitions) if p not in taken]
        held = {member.partition for member in self._members.values()}
        unheld = [p for p in free if p not in held]
        choices = unheld or free
        return choices[0] if choices else None
