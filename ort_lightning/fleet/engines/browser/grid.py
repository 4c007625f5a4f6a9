"""`BrowserGrid`: a Flower ``Grid`` whose nodes are the browsers connected to a `BrowserFleet`.

Like `LocalGrid`, but a train message is not run here: `push_messages` sends each one to its
browser at once (the round's weights, flat float32 in the training graph's order, and the
device's batches for each local epoch), so the browsers train in parallel, and
`send_and_receive` collects their replies, each one checked by the hub before it becomes a reply
(``arrays``, ``metrics`` with ``num-examples``, ``train_loss``, ``fit_seconds``). A browser that
closes, is refused or exceeds the device timeout answers with an error reply, as a failed
node does in Flower's runtimes, and the strategy aggregates the others.

Flower's SecAgg+ workflow runs over the same frames: its key stages travel as ``secagg`` frames
(`record_frame`), and its collect stage as a train frame carrying the stage's record, which the
device answers with its masked vectors instead of its weights. Only the thread that runs the
server waits for devices in `get_node_ids`: the legacy workflow polls from a thread of its own too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any
from uuid import uuid4

import torch
from flwr.app import ArrayRecord, Message, MessageType
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Stage

from ort_lightning.errors import FleetError
from ort_lightning.fleet.devices.frames import record_frame, train_frame
from ort_lightning.fleet.devices.legacy_fit import fit_request, stage_of
from ort_lightning.fleet.devices.protocol import ARRAYS_KEY
from ort_lightning.fleet.engines.browser.hub import Hub
from ort_lightning.fleet.engines.browser.reply import Asked, clipping_norm
from ort_lightning.fleet.engines.local import ServerGrid

__all__ = ["BrowserGrid", "Epochs", "PageData", "strategy_floor"]

#: A partition's batches for one round: per local epoch, its batches, each in the training graph's input order.
Epochs = list[list[Sequence[torch.Tensor]]]


@dataclass(frozen=True)
class PageData:
    """The pages make their own batches (the fleet's data module): only the weights travel.

    Attributes:
        epochs: local epochs per round (the page calls the module's ``batches`` once per epoch).
        max_examples: the most examples per epoch a device may claim (the server cannot count them).
    """

    epochs: int
    max_examples: int


class BrowserGrid(ServerGrid):
    """The connected browsers as Flower nodes (see the module docstring).

    Args:
        hub: the fleet's devices and the replies they owe.
        batches: ``partition -> Epochs``, what a device of that partition trains in a round; or
            `PageData` when the pages make their own batches.
        floor: the fewest pages a round needs (the strategy's minimums, `strategy_floor`, less any simulated devices
            beside them).
        wait_timeout: seconds to wait for `floor` devices when fewer are connected (None: no limit).
    """

    def __init__(
        self, hub: Hub, batches: Callable[[int], Epochs] | PageData, *, floor: int = 1,
        wait_timeout: float | None = None,
    ) -> None:
        super().__init__()
        self._hub = hub
        self._batches = batches
        self._ids = count()
        self._floor = floor
        self._wait_timeout = wait_timeout
        self._server_thread = threading.current_thread()

    def get_node_ids(self) -> Iterable[int]:
        """The node ids of the browsers that are ready, in joining order; waits (bounded) while they are too few.

        Raises:
            FleetError: fewer than the strategy's minimum stayed connected for `wait_timeout` seconds.
        """
        # NOTE: Flower's strategies poll this once a second, for ever, while fewer nodes than their minimum are
        # connected; waiting here, with a bound, is what ends a run whose devices have gone. The legacy workflow's
        # own polling thread must not wait: the run's end joins it.
        if threading.current_thread() is not self._server_thread:
            return self._hub.node_ids()
        if not self._hub.wait_for(self._floor, self._wait_timeout):
            connected = len(self._hub.node_ids())
            raise FleetError(f"The fleet waited {self._wait_timeout:g} s after round {self._hub.server_round} for "
                             f"{self._floor} devices (the strategy's minimum), but {connected} stayed connected; the "
                             "run stops here and the finished rounds' checkpoints stay. Raise wait_timeout, lower "
                             "the strategy's min_available_nodes/min_train_nodes, or bring devices back.")
        return self._hub.node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Send each train message to its browser; anything else is answered with an error reply at once.

        Every frame is built before the first one leaves, so that the browsers start their round together.
        """
        ids, frames = [], []
        for message in messages:
            message.metadata.__dict__["_message_id"] = f"{next(self._ids)}-{uuid4().hex}"
            ids.append(message.metadata.message_id)
            frames.append(self._frame(message))
        for frame in frames:
            if frame is not None:
                self._hub.send(*frame)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to `message_ids` that are in (each is handed out once)."""
        return self._hub.collect(list(message_ids), wait=0.0)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Send every message, then wait up to `timeout` seconds for the replies (each device has its own timeout)."""
        return self.collect(self.push_messages(messages), timeout=timeout)

    def collect(self, message_ids: Iterable[str], *, timeout: float | None) -> list[Message]:
        """The replies to pushed `message_ids` within `timeout` s; a page that has not answered then is owed no more."""
        return self._hub.collect(list(message_ids), wait=timeout, close=True)

    def _frame(self, message: Message) -> tuple[Message, bytes, Asked] | None:
        """What `Hub.send` takes for a train message (a SecAgg+ stage's included): the message, its frame, its ask."""
        if message.metadata.message_type != MessageType.TRAIN:
            kind = message.metadata.message_type
            self._hub.answer(message, f"browser devices answer train messages only, not {kind!r}; pass the strategy "
                                      "fraction_evaluate=0.0 (the server evaluates the global model on its test data)")
            return None
        node = message.metadata.dst_node_id
        device = self._hub.device(node)
        if device is None:
            self._hub.answer(message, f"node {node} is not a connected browser (it left)")
            return None
        server_round, stage = _round(message), stage_of(message)
        if stage is not None and stage != Stage.COLLECT_MASKED_VECTORS:
            record = dict(message.content.config_records[RECORD_KEY_CONFIGS])
            return message, record_frame(message.metadata.message_id, server_round, node, record), Asked(
                0, None, server_round, stage)
        content = self._content(message)
        epochs: Epochs = [] if isinstance(self._batches, PageData) else self._batches(device.partition)
        local = None
        if isinstance(self._batches, PageData):
            local = {"partition": device.partition, "partitions": self._hub.partitions, "epochs": self._batches.epochs}
        frame = train_frame(message.metadata.message_id, server_round, self._hub.weight_order.flat(content.arrays),
                            epochs, local=local, clip=content.clip, secagg=content.secagg, layout=content.layout)
        if isinstance(self._batches, PageData):
            return message, frame, Asked(self._batches.max_examples, None, server_round, stage, content.clip,
                                         content.shapes)
        given = sum(int(batch[0].shape[0]) for batch in epochs[0])
        return message, frame, Asked(given, len(epochs[-1]), server_round, stage, content.clip, content.shapes)

    def _content(self, message: Message) -> _TrainContent:
        """A train message's content; at SecAgg+'s collect stage, read from Flower's legacy fit instruction."""
        if stage_of(message) is None:
            return _TrainContent(message.content.array_records[ARRAYS_KEY], clipping_norm(message))
        request = fit_request(message.content)
        arrays = request.array_records[ARRAYS_KEY]
        spans = self._hub.weight_order.spans
        clip = request.config_records["config"].get("clipping_norm")
        return _TrainContent(arrays, None if clip is None else float(clip),  # type: ignore[arg-type]
                             secagg=dict(message.content.config_records[RECORD_KEY_CONFIGS]),
                             layout=[[*spans[name], list(arrays[name].shape)] for name in arrays],
                             shapes=tuple(tuple(arrays[name].shape) for name in arrays))


@dataclass(frozen=True)
class _TrainContent:
    """What a train frame carries beside the batches: the arrays, the clipping norm and, for SecAgg+, the stage.

    Attributes:
        secagg: the collect stage's record (None: a plain round).
        layout: ``[start, end, shape]`` of each legacy parameter in the flat weights, in the order Flower sums the
            masked vectors; `shapes` are theirs.
    """

    arrays: ArrayRecord
    clip: float | None
    secagg: dict[str, Any] | None = None
    layout: list[list[Any]] | None = None
    shapes: tuple[tuple[int, ...], ...] = ()


def _round(message: Message) -> int:
    config = message.content.config_records.get("config")
    if config is not None and "server-round" in config:
        return int(config["server-round"])  # type: ignore[arg-type]
    group = message.metadata.group_id
    return int(group) if group.isdigit() else 0


def strategy_floor(strategy: object) -> int:
    """The fewest devices a round of `strategy` needs: its minimums of available and training nodes (else 1).

    Flower's Message-API strategies call them ``min_available_nodes`` and ``min_train_nodes``, its legacy ones
    (which SecAgg+ runs) ``min_available_clients`` and ``min_fit_clients``.
    """
    # NOTE: Flower's DP wrappers and the fleet's checkpointing hold the strategy that samples as `.strategy`; the
    # secure server's round keeper as `.inner`.
    keys = ("min_available_nodes", "min_train_nodes", "min_available_clients", "min_fit_clients")
    while not any(hasattr(strategy, key) for key in keys):
        inner = getattr(strategy, "strategy", getattr(strategy, "inner", None))
        if inner is None:
            break
        strategy = inner
    minimums = [getattr(strategy, key, 1) for key in keys]
    return max(1, *(int(value) for value in minimums if isinstance(value, int)))
