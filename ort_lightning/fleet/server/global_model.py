"""The server side of a fleet: Flower's own strategies, and a complete ORT checkpoint after every round.

`GlobalModel` holds the global values in an ORT state built from the artifacts (a module the
server never trains), evaluates them through the eval graph and writes them as ORT checkpoint
files, atomically and with a ``.sha256`` digest (the writes `ORTCheckpoint` makes), so that
any round can be shipped to devices or resumed from. `CheckpointEachRound` wraps any Flower
strategy (FedAvg, FedProx, FedAdam, ...): after the strategy aggregates a round it writes
``round-NNNN.ortckpt`` and replaces ``last.ortckpt``. A round whose clients all failed writes
nothing, and the files of earlier rounds stay as they were.

Example::

    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from ort_lightning import export_artifacts
    >>> folder = Path(tempfile.mkdtemp())
    >>> model = GlobalModel(export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), folder / "a", verify=False))
    >>> path = model.save(folder / "round-0000.ortckpt", server_round=0)
    >>> GlobalModel(folder / "a", checkpoint=path).server_round
    0
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from torch.utils.data import DataLoader

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.fleet.devices.protocol import LEFT_ERROR_CODE, WEIGHT_KEY
from ort_lightning.fleet.devices.state_values import load_sent, sent_values
from ort_lightning.fleet.devices.trainer_loop import evaluate_module
from ort_lightning.training.module import ORTLightningModule

__all__ = ["ROUND_PROPERTY", "CheckpointEachRound", "GlobalModel", "round_path"]

#: Checkpoint property holding the last aggregated round.
ROUND_PROPERTY = "fleet_round"
LAST_NAME = "last.ortckpt"


def round_path(directory: str | os.PathLike[str], server_round: int) -> Path:
    """The checkpoint file of `server_round` in `directory` (``round-0003.ortckpt``)."""
    return Path(directory) / f"round-{server_round:04d}.ortckpt"


class GlobalModel:
    """The global values of a fleet, in an ORT state built from the artifacts the devices train.

    Args:
        artifacts: the artifacts (or their folder).
        checkpoint: an ORT checkpoint to start from (a round written by `save`, to resume);
            None starts from the artifacts' own initial checkpoint.
    """

    def __init__(
        self, artifacts: TrainingArtifacts | str | os.PathLike[str], *, checkpoint: str | os.PathLike[str] | None = None
    ) -> None:
        self.module = ORTLightningModule(artifacts, checkpoint=checkpoint, lr_scheduler="constant")
        # NOTE: the module read and checked the file once; its properties come from that read.
        properties = self.module.checkpointing.run.origin.properties
        #: The round the values come from (0: the start; a resumed file's round otherwise).
        self.server_round = int(properties.get(ROUND_PROPERTY, 0))
        if checkpoint is not None:
            # NOTE: the server goes on with the fleet's rounds, not with the steps and epochs of the run that wrote
            # the file (a Lightning run's ORTCheckpoint file): its round files record rounds alone.
            self.module.checkpointing.count_from_zero()

    def arrays(self) -> ArrayRecord:
        """The global values a fleet sends as Flower's ``ArrayRecord`` (all but the frozen parameters, in order)."""
        return ArrayRecord(sent_values(self.module))

    def load(self, arrays: ArrayRecord, *, server_round: int) -> None:
        """Copy aggregated values into the ORT state (in place; frozen parameters keep their first values)."""
        load_sent(self.module, arrays.to_torch_state_dict())
        self.server_round = server_round

    def save(self, path: str | os.PathLike[str], *, server_round: int | None = None) -> Path:
        """Write the global values as a complete ORT checkpoint file, atomically, with its digest."""
        server_round = self.server_round if server_round is None else server_round
        return self.module.save_ort_checkpoint(
            path, include_optimizer_state=False, properties={ROUND_PROPERTY: server_round}
        )

    def evaluate(self, loader: DataLoader) -> dict[str, float]:
        """Loss and accuracy (a language model's perplexity) of the global values through the eval graph."""
        return evaluate_module(self.module, loader)

    def evaluate_fn(self, loader: DataLoader) -> Callable[[int, ArrayRecord], MetricRecord]:
        """A centralized evaluation for ``Strategy.start(evaluate_fn=...)`` on `loader`."""

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            load_sent(self.module, arrays.to_torch_state_dict())
            result = self.evaluate(loader)
            return MetricRecord({key: value for key, value in result.items() if key not in ("examples", "tokens")})

        return evaluate


def _answers(replies: list[Message]) -> tuple[int, int]:
    valid = [reply for reply in replies if not reply.has_error()]
    examples = 0
    for reply in valid:
        for record in reply.content.metric_records.values():
            examples += int(cast(float, record.get(WEIGHT_KEY, 0)))
    return len(valid), examples


def message_bytes(message: Message) -> int:
    """The bytes of a message's arrays (their ``.npy`` data, header included): what its weights weigh on the wire."""
    if message.has_error():
        return 0
    return sum(len(array.data) for record in message.content.array_records.values() for array in record.values())


def _traffic(sent: list[Message], replies: list[Message]) -> tuple[int, int]:
    """Per device: the bytes of the arrays it was sent, and of those it replied (the mean over the answers)."""
    answered = [reply for reply in replies if not reply.has_error()]
    out = max((message_bytes(message) for message in sent), default=0)
    back = sum(map(message_bytes, answered)) // len(answered) if answered else 0
    return out, back


def _failures(
    sent: list[Message], replies: list[Message], timeout: float | None
) -> tuple[dict[int, str], dict[int, str]]:
    """Node id -> why it failed the round (an error reply, or none in time); node id -> why it left the fleet."""
    # NOTE: a reply is matched to the node it was sent to: an error reply written by the SuperLink for a
    # node it lost (Flower's "Node Unavailable") comes from the SuperLink, not from that node.
    nodes = {message.metadata.message_id: message.metadata.dst_node_id for message in sent}
    failures: dict[int, str] = {}
    left: dict[int, str] = {}
    answered = set()
    for reply in replies:
        node = nodes.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
        answered.add(node)
        if reply.has_error():
            (left if reply.error.code == LEFT_ERROR_CODE else failures)[node] = str(reply.error.reason)
    limit = "" if timeout is None else f" of {timeout:g} s"
    for node in nodes.values():
        if node not in answered:
            failures[node] = f"no reply within the device timeout{limit}; the round went on without it"
    return failures, left


class CheckpointEachRound(Strategy):
    """Any Flower strategy, plus a complete ORT checkpoint of the global values after each round.

    Args:
        strategy: the Flower strategy that samples, configures and aggregates (FedAvg, FedAdam, ...).
        model: the `GlobalModel` the aggregated values are written from.
        directory: where ``round-NNNN.ortckpt`` and ``last.ortckpt`` go.
        round_offset: rounds done before this run (resuming round 3 numbers the next one 4).
        device_timeout: the round's reply timeout, to name it when a device's reply is missing.
    """

    def __init__(
        self, strategy: Strategy, model: GlobalModel, directory: str | os.PathLike[str], *, round_offset: int = 0,
        device_timeout: float | None = None,
    ) -> None:
        self.strategy = strategy
        self.model = model
        self.directory = Path(directory)
        self.round_offset = round_offset
        self.device_timeout = device_timeout
        self.written: list[Path] = []
        #: Per round: (devices that answered, their examples), counted from the replies.
        self.answers: dict[int, tuple[int, int]] = {}
        #: Per round: node id -> why it failed its training (an error reply, or none before the timeout).
        self.failures: dict[int, dict[int, str]] = {}
        #: Per round: node id -> why it left the fleet while it owed the round (on purpose: no failure).
        self.left: dict[int, dict[int, str]] = {}
        self._sent: dict[int, list[Message]] = {}
        #: Per round: the bytes of the arrays sent to each device, and of those each answer held (mean).
        self.traffic: dict[int, tuple[int, int]] = {}
        #: Per round: (seconds aggregating, seconds writing the checkpoints).
        self.seconds: dict[int, tuple[float, float]] = {}

    def summary(self) -> None:
        """Log the wrapped strategy's summary."""
        self.strategy.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's training messages (their nodes kept, to name those that never answer)."""
        messages = list(self.strategy.configure_train(server_round + self.round_offset, arrays, config, grid))
        self._sent[server_round + self.round_offset] = messages
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate with the wrapped strategy, then write the round's checkpoint (when it aggregated anything)."""
        server_round += self.round_offset
        replies = list(replies)
        self.answers[server_round] = _answers(replies)
        sent = self._sent.pop(server_round, [])
        self.traffic[server_round] = _traffic(sent, replies)
        self.failures[server_round], self.left[server_round] = _failures(sent, replies, self.device_timeout)
        started = time.perf_counter()
        arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        aggregated = time.perf_counter()
        if arrays is not None:
            self.model.load(arrays, server_round=server_round)
            path = self.model.save(round_path(self.directory, server_round))
            self.model.save(self.directory / LAST_NAME)
            self.written.append(path)
        self.seconds[server_round] = (aggregated - started, time.perf_counter() - aggregated)
        return arrays, metrics

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The wrapped strategy's evaluation messages."""
        return self.strategy.configure_evaluate(server_round + self.round_offset, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The wrapped strategy's aggregated evaluation."""
        return self.strategy.aggregate_evaluate(server_round + self.round_offset, replies)

    def __getattr__(self, name: str) -> Any:
        # NOTE: options of the wrapped strategy (fraction_train, ...) read through the wrapper.
        if name == "strategy":
            raise AttributeError(name)
        return getattr(self.strategy, name)
