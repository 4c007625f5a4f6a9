"""`JoinedGrid`: two grids as one Flower ``Grid``, so that simulated devices join a browser fleet's rounds.

Each node id belongs to one of the two grids, and a message goes to its node's grid. `send_and_receive`
pushes the messages of the grid whose devices answer later (the pages) first, so that they train while
the other grid (`LocalGrid`) runs its devices in this thread, then collects the pages' replies within
what is left of the timeout. Flower's workflows, SecAgg+'s included, see one fleet.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message
from flwr.supercore.run import Run

from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.engines.local import LocalGrid, ServerGrid

__all__ = ["JoinedGrid"]


class JoinedGrid(ServerGrid):
    """The nodes of `ahead` and of `here`, routed by ``dst_node_id`` (see the module docstring).

    Args:
        ahead: the grid whose devices answer after the push (a `BrowserGrid`); every node id `here` lacks is its.
        here: the simulated devices (a `LocalGrid`, whose node ids are fixed), run as their messages are pushed.
    """

    def __init__(self, ahead: ServerGrid, here: LocalGrid) -> None:
        super().__init__()
        self.ahead, self.here = ahead, here
        self._here_ids = list(here.get_node_ids())
        self._here = set(self._here_ids)
        self._owners: dict[str, ServerGrid] = {}

    def get_node_ids(self) -> Iterable[int]:
        """`ahead`'s node ids (it may wait for its devices), then `here`'s.

        Raises:
            ConfigurationError: a node id both grids hold, which no message could be routed to.
        """
        ahead = list(self.ahead.get_node_ids())
        shared = sorted(self._here.intersection(ahead))
        if shared:
            raise ConfigurationError(f"Node ids {shared[:5]} belong to both joined grids, so a message to one cannot "
                                     "be routed; give the LocalGrid a first_node beyond the other grid's ids (a "
                                     "BrowserFleet's pages are 1, 2, 3...: e.g. first_node=2**60).")
        return [*ahead, *self._here_ids]

    def set_run(self, run: Run) -> None:
        """Adopt `run`, and so do both grids."""
        super().set_run(run)
        self.ahead.set_run(run)
        self.here.set_run(run)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push `ahead`'s messages, then run `here`'s; the ids, `ahead`'s first."""
        ahead, here = self._split(messages)
        return [*self._push(self.ahead, ahead), *self._push(self.here, here)]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to `message_ids` that are in, from the grid each was pushed to."""
        return self._gather(message_ids, None, wait=False)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push `ahead`'s messages, run `here`'s, then wait for `ahead`'s replies within what is left of `timeout`."""
        ahead, here = self._split(messages)
        started = time.monotonic()
        sent = self._push(self.ahead, ahead)
        replies = list(self.here.send_and_receive(here, timeout=timeout))
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        return [*self._gather(sent, left, wait=True), *replies]

    def _split(self, messages: Iterable[Message]) -> tuple[list[Message], list[Message]]:
        ahead: list[Message] = []
        here: list[Message] = []
        for message in messages:
            (here if message.metadata.dst_node_id in self._here else ahead).append(message)
        return ahead, here

    def _push(self, grid: ServerGrid, messages: list[Message]) -> list[str]:
        ids = list(grid.push_messages(messages)) if messages else []
        self._owners.update(dict.fromkeys(ids, grid))
        return ids

    def _gather(self, message_ids: Iterable[str], timeout: float | None, *, wait: bool) -> list[Message]:
        """The replies in from each message's grid (with `wait`: what `ahead` collects within `timeout`)."""
        wanted = [i for i in message_ids if i in self._owners]
        replies: list[Message] = []
        for grid in (self.ahead, self.here):
            mine = [i for i in wanted if self._owners[i] is grid]
            if mine:
                replies += grid.collect(mine, timeout=timeout) if wait else list(grid.pull_messages(mine))
        for reply in replies:
            self._owners.pop(reply.metadata.reply_to_message_id, None)
        if wait:
            for message_id in wanted:
                self._owners.pop(message_id, None)
        return replies
