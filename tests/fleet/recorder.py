"""The transport of a secure fleet's tests: a Grid that keeps what Flower's workflow sends and each node replies.

Shared by the secure fleet's tests of every engine (in-process devices, pages beside Python devices).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

__all__ = ["Recorder"]


class Recorder(Grid):
    """Every message the server sends (`sent`) and every reply each node sends (`replies`, by node), kept."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.replies: dict[int, list[RecordDict]] = {}
        self.sent: list[Message] = []

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        self.sent += messages
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for reply in replies:
            if not reply.has_error():
                self.replies.setdefault(reply.metadata.src_node_id, []).append(reply.content)
        return replies

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def _unused(self, *_: Any, **__: Any) -> Any:
        raise NotImplementedError("the workflow only sends, receives and lists the nodes")

    set_run = push_messages = pull_messages = create_message = _unused

    @property
    def run(self) -> Any:
        return self.grid.run
