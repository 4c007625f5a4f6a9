"""Run Flower apps in this process: the same `ServerApp`, `ClientApp` and strategies, without Ray.

`LocalGrid` is a Flower ``Grid`` that hands each message to the `ClientApp` of its node at
once, one message after another, with a `Context` per node that lives as long as the grid (as
a SuperNode's does across rounds). A client that raises is answered with an error reply, the
way Flower's runtimes answer it, so strategies see the same replies. Use it for exact,
repeatable experiments and tests; use ``flwr.simulation`` or a deployment for scale.

A device that hangs does not hang the round: each message runs in a worker thread of its own,
and a call still running after the device timeout (``send_and_receive(timeout=...)``, which
``Strategy.start`` passes, or `LocalGrid`'s ``device_timeout``) is answered with an error reply
that names the node and the limit, and the next device runs. Python cannot stop a thread, so
the abandoned call runs on in the background until it returns; its late reply is dropped, and
its node answers every later message at once with an error reply until then (the node's
Context is still in that call's hands). The worker is a daemon thread: it does not keep the
process alive at exit.

Example::

    >>> from flwr.app import Context, Message, RecordDict
    >>> from flwr.clientapp import ClientApp
    >>> app = ClientApp()
    >>> @app.query()
    ... def echo(message: Message, context: Context) -> Message:
    ...     return Message(RecordDict(), reply_to=message)
    >>> grid = LocalGrid(app, nodes=2)
    >>> replies = grid.send_and_receive([Message(RecordDict(), dst_node_id=n, message_type="query")
    ...                                   for n in grid.get_node_ids()])
    >>> [reply.has_error() for reply in replies]
    [False, False]
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterable
from itertools import count
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from ort_lightning.errors import ConfigurationError

__all__ = ["CLIENT_ERROR_CODE", "TIMEOUT_ERROR_CODE", "LocalGrid", "ServerGrid", "run_local"]

#: Error code of the reply to a message whose ClientApp raised (Flower's ClientApp exception code).
CLIENT_ERROR_CODE = 1
#: Error code of the reply to a message whose ClientApp did not return in time (Flower's "reply unavailable").
TIMEOUT_ERROR_CODE = ErrorCode.REPLY_MESSAGE_UNAVAILABLE
_RUN_ID = 1
#: The largest node id Flower's messages carry (uint64).
_LAST_NODE = 2**64 - 1


class ServerGrid(Grid):
    """What a Grid run by this process's ServerApp shares: one run, its identity claimed, messages built.

    `LocalGrid` (devices in this process) and the browser fleet's grid (devices in pages) add how
    messages reach their nodes and come back.
    """

    def __init__(self) -> None:
        _claim_identity()
        self._run = Run.create_empty(_RUN_ID)

    def set_run(self, run: Run) -> None:
        """Adopt `run` (the grid serves one run at a time)."""
        self._run = run

    @property
    def run(self) -> Run:
        """The run this grid serves."""
        return self._run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        """A message to `dst_node_id` (Flower deprecates this in favour of the Message constructor)."""
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def collect(self, message_ids: Iterable[str], *, timeout: float | None) -> list[Message]:
        """The replies to pushed `message_ids`, waiting up to `timeout` s for the rest; a late one is owed no more.

        `LocalGrid` answers as it is pushed, so its replies are all in; the browsers' grid waits for its pages.
        """
        return list(self.pull_messages(message_ids))


class LocalGrid(ServerGrid):
    """A Flower ``Grid`` whose nodes run `client_app` in this process, one message after another.

    Args:
        client_app: the ClientApp every node runs.
        nodes: number of nodes; node ``i`` gets ``node_config={"partition-id": i, "num-partitions": nodes}``
            as in Flower's simulation.
        first_node: the first node's id (the next are ``first_node + 1``...): other ids than another grid's, for
            devices beside a `BrowserFleet`'s pages (which are 1, 2, 3...).
        run_config: the run config every node's Context carries.
        device_timeout: seconds one node may take to answer one message before it is answered with
            an error reply and abandoned (see the module docstring); None waits as long as
            ``send_and_receive``'s ``timeout`` says, or for ever without one.
    """

    def __init__(
        self, client_app: ClientApp, *, nodes: int, run_config: dict | None = None,
        device_timeout: float | None = None, first_node: int = 1,
    ) -> None:
        if nodes < 1:
            raise ValueError(f"Expected `nodes` >= 1, but got {nodes}; pass the number of simulated devices.")
        if not 1 <= first_node <= _LAST_NODE - nodes + 1:
            raise ConfigurationError(f"Expected `first_node` from 1 to {_LAST_NODE - nodes + 1} (Flower's node ids are "
                                     f"unsigned 64-bit, 0 is the server's), but got {first_node}; pass the first "
                                     "simulated device's node id.")
        _check_timeout(device_timeout)
        super().__init__()
        self._app = client_app
        config = dict(run_config or {})
        self._contexts = {
            node_id: Context(_RUN_ID, node_id, {"partition-id": i, "num-partitions": nodes}, RecordDict(), config)
            for i, node_id in enumerate(range(first_node, first_node + nodes))
        }
        self._replies: dict[str, Message] = {}
        self._ids = count()
        self.device_timeout = device_timeout
        #: Per node: the worker thread of a call abandoned after the timeout, while it still runs.
        self._abandoned: dict[int, threading.Thread] = {}

    def context(self, node_id: int) -> Context:
        """The Context of node `node_id` (its ``state`` is what the node keeps between rounds)."""
        return self._contexts[node_id]

    def get_node_ids(self) -> Iterable[int]:
        """The ids of the nodes, in order."""
        return list(self._contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Run each message's node on it now (for at most `device_timeout` s each); keep the replies."""
        return self._push(messages, self.device_timeout)

    def _push(self, messages: Iterable[Message], timeout: float | None) -> list[str]:
        ids = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"{next(self._ids)}-{uuid4().hex}"
            self._replies[message.metadata.message_id] = self._deliver(message, timeout)
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to `message_ids` (each is handed out once)."""
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Run every message, each node for at most `timeout` s (and `device_timeout`); return the replies."""
        _check_timeout(timeout)
        limits = [t for t in (timeout, self.device_timeout) if t is not None]
        return self.pull_messages(self._push(messages, min(limits) if limits else None))

    def _deliver(self, message: Message, timeout: float | None) -> Message:
        node = message.metadata.dst_node_id
        context = self._contexts.get(node)
        if context is None:
            return Message(Error(CLIENT_ERROR_CODE, f"no node {node}"), reply_to=message)
        busy = self._abandoned.get(node)
        if busy is not None and busy.is_alive():
            return Message(Error(TIMEOUT_ERROR_CODE, f"node {node} is still running a message it was given up on "
                                 "earlier; it gets no new one until that call returns"), reply_to=message)
        self._abandoned.pop(node, None)
        answer: list[Message] = []
        worker = threading.Thread(target=self._answer, args=(message, context, answer), daemon=True,
                                  name=f"fleet-node-{node}")
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            self._abandoned[node] = worker
            reason = (f"node {node} did not answer within the device timeout of {timeout:g} s; its call was "
                      "abandoned and the round goes on without it (raise the device timeout if its training needs "
                      "longer)")
            return Message(Error(TIMEOUT_ERROR_CODE, reason), reply_to=message)
        return answer[0]

    def _answer(self, message: Message, context: Context, answer: list[Message]) -> None:
        """The node's reply to `message`, into `answer` (run in the delivery's worker thread)."""
        try:
            answer.append(self._app(_copied(message), context))
        except Exception as error:  # any device failure becomes an error reply, as in Flower's runtimes
            reason = f"{type(error).__name__}: {' '.join(str(error).split())}"
            answer.append(Message(Error(CLIENT_ERROR_CODE, reason), reply_to=message))


def _copied(message: Message) -> Message:
    """`message` as its node receives it over a wire: a copy, so that what one node changes no other node sees."""
    # NOTE: Flower's SecAgg+ workflow sends one RecordDict to every node, and its client mod pops keys from it.
    return copy.deepcopy(message)


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise ConfigurationError(
            f"Expected a device timeout > 0 seconds (or None: no limit), but got {timeout!r}; pass how long one "
            "device may take to answer a round."
        )


def _claim_identity() -> None:
    """Say, as Flower's runtimes do, which task this process runs: Messages are stamped with it."""
    # NOTE: Flower reads the run id from a process-wide identity when a Message is created;
    # its runtimes set it at start-up, and a process that already has one keeps it.
    try:
        TaskIdentity.run_id  # noqa: B018 - Flower's getter raises RuntimeError while no run id is set
    except RuntimeError:
        TaskIdentity.task_id = 1
        TaskIdentity.run_id = _RUN_ID
        TaskIdentity.node_id = SUPERLINK_NODE_ID


def run_local(
    server_app: ServerApp, client_app: ClientApp, *, nodes: int, run_config: dict | None = None,
    device_timeout: float | None = None,
) -> None:
    """Run `server_app` against `nodes` in-process nodes running `client_app` (see `LocalGrid`).

    A `FleetServer`'s ``device_timeout`` reaches the grid through ``Strategy.start``; `device_timeout`
    here bounds every message too (None: only what the server app passes).
    """
    grid = LocalGrid(client_app, nodes=nodes, run_config=run_config, device_timeout=device_timeout)
    context = Context(_RUN_ID, 0, {}, RecordDict(), dict(run_config or {}))
    server_app(grid, context)
