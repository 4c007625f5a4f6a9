"""`BrowserGrid`: a Flower ``Grid`` whose nodes are the browsers connected to a `BrowserFleet`.

Like `LocalGrid`, but a train message is not run here: `push_messages` sends each one to its
browser at once (the round's weights, flat float32 in the training graph's order, and the
device's batches for each local epoch), so the browsers train in parallel, and
`send_and_receive` collects their replies, each one checked by the hub before it becomes a reply
(``arrays``, ``metrics`` with ``num-examples``, ``train_loss``, ``fit_seconds``). A browser that
closes, is refused or exceeds the device timeout answers with an error reply, as a failed
node does in Flower's runtimes, and the strategy aggregates the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import count
from uuid import uuid4

import numpy as np
import torch
from flwr.app import Message, MessageType

from ort_lightning.errors import FleetError
from ort_lightning.fleet.devices.frames import train_frame
from ort_lightning.fleet.devices.protocol import ARRAYS_KEY
from ort_lightning.fleet.engines.browser.hub import Hub
from ort_lightning.fleet.engines.browser.reply import clipping_norm
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
        floor: the fewest devices a round needs (the strategy's minimums, `strategy_floor`).
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

    def get_node_ids(self) -> Iterable[int]:
        """The node ids of the browsers that are ready, in joining order; waits (bounded) while they are too few.

        Raises:
            FleetError: fewer than the strategy's minimum stayed connected for `wait_timeout` seconds.
        """
        # NOTE: Flower's strategies poll this once a second, for ever, while fewer nodes than their minimum are
        # connected; waiting here, with a bound, is what ends a run whose devices have gone.
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
        return self._hub.collect(list(self.push_messages(messages)), wait=timeout, close=True)

    def _frame(self, message: Message) -> tuple[Message, bytes, int, int | None, int] | None:
        """What `Hub.send` takes for a train message: (message, frame, examples given, last epoch's steps, round)."""
        if message.metadata.message_type != MessageType.TRAIN:
            kind = message.metadata.message_type
            self._hub.answer(message, f"browser devices answer train messages only, not {kind!r}; pass the strategy "
                                      "fraction_evaluate=0.0 (the server evaluates the global model on its test data)")
            return None
        device = self._hub.device(message.metadata.dst_node_id)
        if device is None:
            self._hub.answer(message, f"node {message.metadata.dst_node_id} is not a connected browser (it left)")
            return None
        server_round = _round(message)
        if isinstance(self._batches, PageData):
            local = {"partition": device.partition, "partitions": self._hub.partitions, "epochs": self._batches.epochs}
            frame = train_frame(message.metadata.message_id, server_round, self._flat(message), [], local=local,
                                clip=clipping_norm(message))
            return message, frame, self._batches.max_examples, None, server_round
        epochs = self._batches(device.partition)
        frame = train_frame(message.metadata.message_id, server_round, self._flat(message), epochs,
                            clip=clipping_norm(message))
        given = sum(int(batch[0].shape[0]) for batch in epochs[0])
        return message, frame, given, len(epochs[-1]), server_round

    def _flat(self, message: Message) -> np.ndarray:
        """The message's arrays as one float32 buffer in the hub's `WeightOrder`."""
        return self._hub.weight_order.flat(message.content.array_records[ARRAYS_KEY])


def _round(message: Message) -> int:
    config = message.content.config_records.get("config")
    if config is not None and "server-round" in config:
        return int(config["server-round"])  # type: ignore[arg-type]
    group = message.metadata.group_id
    return int(group) if group.isdigit() else 0


def strategy_floor(strategy: object) -> int:
    """The fewest devices a round of `strategy` needs: its ``min_available_nodes`` and ``min_train_nodes`` (else 1)."""
    # NOTE: Flower's DP wrappers and the fleet's checkpointing hold the strategy that samples as `.strategy`.
    while not hasattr(strategy, "min_train_nodes") and hasattr(strategy, "strategy"):
        strategy = strategy.strategy
    minimums = [getattr(strategy, key, 1) for key in ("min_available_nodes", "min_train_nodes")]
    return max(1, *(int(value) for value in minimums if isinstance(value, int)))
