"""The server app of a fleet run: a Flower ``ServerApp`` that runs a strategy for some rounds.

`FleetServer` starts from a `GlobalModel`, wraps the strategy in `CheckpointEachRound`, runs
``Strategy.start`` (Flower's own round loop) and keeps what each round produced: the global
evaluation (loss, accuracy through the eval graph), the clients' aggregated metrics and the
round's wall time. The same object serves `run_local` (in this process) and Flower's Ray
simulation (``flwr.simulation.run_simulation``), whose ServerApp runs in this process too.

Example::

    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> from ort_lightning import export_artifacts
    >>> from ort_lightning.fleet import ClientData, DeviceClient, GlobalModel, run_local, strategy_from
    >>> folder = Path(tempfile.mkdtemp())
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), folder / "a", verify=False)
    >>> def data(partition: int, partitions: int) -> ClientData:
    ...     x = torch.randn(8, 4, generator=torch.Generator().manual_seed(partition))
    ...     return ClientData(train=DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4))
    >>> fedavg = strategy_from({"name": "fedavg"}, None, devices=2)
    >>> server = FleetServer(GlobalModel(artifacts), fedavg, rounds=2, directory=folder / "rounds")
    >>> run_local(server.server_app(), DeviceClient(artifacts.directory, data).client_app(), nodes=2)
    >>> [round.server_round for round in server.history], sorted(p.name for p in (folder / "rounds").glob("*.ortckpt"))
    ([1, 2], ['last.ortckpt', 'round-0001.ortckpt', 'round-0002.ortckpt'])
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy
from torch.utils.data import DataLoader

from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.devices.protocol import DEVICE_TIMEOUT
from ort_lightning.fleet.server.global_model import CheckpointEachRound, GlobalModel, round_path

__all__ = ["DEVICE_TIMEOUT", "FleetServer", "RoundRecord", "app_running"]


@dataclass
class RoundRecord:
    """What one round produced.

    Attributes:
        server_round: the round's number (counted across resumes).
        seconds: wall time from the end of the previous round (train, aggregate, checkpoint, evaluate).
        evaluation: the global values' loss and accuracy on the server's test data, if any.
        train_metrics: the clients' training metrics, aggregated by the strategy.
        checkpoint: the round's ORT checkpoint, or None when no client answered.
        devices: clients whose training replies arrived without error.
        failures: node id -> why that client failed its training this round (its error reply's
            reason, or no reply within the device timeout); the round aggregated the others.
        left: node id -> why that device left the fleet on purpose while it owed this round (not a failure).
        examples: their training examples, together (FedAvg's total weight).
        aggregate_seconds: the strategy's aggregation.
        checkpoint_seconds: writing the round's checkpoint files.
        sent_bytes: the bytes of the values sent to each device (Flower's arrays, ``.npy`` headers included).
        received_bytes: the bytes of the values each device sent back (the mean over the answers).
        halted: why the round aggregated nothing though devices answered (secure aggregation below its
            threshold); None otherwise.
    """

    server_round: int
    seconds: float
    evaluation: dict[str, Any] = field(default_factory=dict)
    train_metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint: Path | None = None
    devices: int = 0
    examples: int = 0
    aggregate_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    failures: dict[int, str] = field(default_factory=dict)
    left: dict[int, str] = field(default_factory=dict)
    sent_bytes: int = 0
    received_bytes: int = 0
    halted: str | None = None


class FleetServer:
    """Run `strategy` for `rounds` rounds from `model`; checkpoint each round into `directory`.

    Args:
        model: the global values to start from (and to checkpoint and evaluate).
        strategy: a Flower strategy (``flwr.serverapp.strategy.FedAvg``, ``FedAdam``, ...).
        rounds: rounds to run.
        directory: where the round checkpoints go.
        test: held-out batches to evaluate the global values on after each round (and before the first).
        train_config: values sent to the clients with every train message.
        timeout: seconds to wait for the clients' replies in a round.
        device_timeout: seconds one device may take to answer; a device that takes longer fails
            its round (named in `RoundRecord.failures`) and the round aggregates the others. The
            round's wait is the smaller of this and `timeout`; None leaves only `timeout`.
            Flower's engines wait for all devices at once; `LocalGrid` runs them one after
            another, each with this limit.
    """

    def __init__(
        self,
        model: GlobalModel,
        strategy: Strategy,
        *,
        rounds: int,
        directory: str | os.PathLike[str],
        test: DataLoader | None = None,
        train_config: dict[str, int | float | str] | None = None,
        timeout: float = 3600.0,
        device_timeout: float | None = DEVICE_TIMEOUT,
    ) -> None:
        if rounds < 1:
            raise ValueError(f"Expected `rounds` >= 1, but got {rounds}; pass the number of federated rounds.")
        if device_timeout is not None and not device_timeout > 0:
            raise ConfigurationError(
                f"Expected `device_timeout` > 0 seconds (or None: no limit but `timeout`), but got {device_timeout!r}; "
                "pass how long one device may take to train its round."
            )
        self.device_timeout = device_timeout
        wait = timeout if device_timeout is None else min(timeout, device_timeout)
        self.model = model
        self.strategy = CheckpointEachRound(strategy, model, directory, round_offset=model.server_round,
                                            device_timeout=wait)
        self.rounds = rounds
        self.test = test
        self.train_config = dict(train_config or {})
        self.timeout = wait
        self.history: list[RoundRecord] = []
        self.initial: dict[str, Any] = {}
        self._clock = 0.0

    def server_app(self) -> ServerApp:
        """A Flower ``ServerApp`` whose main runs the rounds (``run_local`` or Flower's simulation runs it)."""
        return app_running(self.main)

    def main(self, grid: Grid, context: Context) -> None:
        """Flower's round loop (``Strategy.start``) over `grid`, recording each round."""
        self._clock = time.perf_counter()
        result = self.strategy.start(
            grid=grid, initial_arrays=self.model.arrays(), num_rounds=self.rounds, timeout=self.timeout,
            train_config=ConfigRecord(dict(self.train_config)), evaluate_fn=self._after_round,
        )
        offset = self.strategy.round_offset
        for record in self.history:
            metrics = result.train_metrics_clientapp.get(record.server_round - offset)
            record.train_metrics = dict(metrics) if metrics is not None else {}

    def _after_round(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Called by ``Strategy.start`` before the first round (0) and after each round."""
        evaluation: dict[str, Any] = {}
        if self.test is not None:
            evaluation = dict(self.strategy.model.evaluate_fn(self.test)(server_round, arrays))
        now = time.perf_counter()
        if server_round == 0:
            self.initial = evaluation
        else:
            number = server_round + self.strategy.round_offset
            written = next((p for p in self.strategy.written if p == round_path(p.parent, number)), None)
            devices, examples = self.strategy.answers.get(number, (0, 0))
            aggregate, save = self.strategy.seconds.get(number, (0.0, 0.0))
            sent, received = self.strategy.traffic.get(number, (0, 0))
            self.history.append(RoundRecord(number, now - self._clock, evaluation, checkpoint=written,
                                            devices=devices, examples=examples, aggregate_seconds=aggregate,
                                            checkpoint_seconds=save,
                                            failures=self.strategy.failures.get(number, {}),
                                            left=self.strategy.left.get(number, {}), sent_bytes=sent,
                                            received_bytes=received))
        self._clock = now
        return MetricRecord(evaluation) if evaluation else None


def app_running(main: Callable[[Grid, Context], None]) -> ServerApp:
    """A Flower ``ServerApp`` whose main is `main` (a fleet server's rounds)."""
    app = ServerApp()
    app.main()(main)
    return app
