"""One fleet of ``python -m benchmarks.fleet``, run in a process of its own: rounds, costs, final values.

Every fleet runs the same `FleetServer` round loop (Flower's ``Strategy.start`` over a
`RecordingFedAvg`), the same digits partitions and the same initial values; only the devices
and the server's global model differ (`DeviceClient` over the ORT device folder, the quickstart's
`TorchClient` or its Lightning twin `LightningTorchClient`, and `GlobalModel` or `TorchGlobalModel`).
The device's costs are measured from outside its code: a Flower mod (`timed`) times each
``train`` call and adds the worker's peak resident memory to the reply; the device's own
``fit_seconds`` (its ``Trainer.fit``, or its torch loop) is its training, the rest of the call
its set-up (building what it trains, loading the values, taking its data, replying).
"""

from __future__ import annotations

import logging
import random
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg

from benchmarks._probes import own_peak_rss_mb, reset_peak_rss

FLEETS = ("ort", "ort-lightning", "lightning", "torch")


@dataclass(frozen=True)
class FleetRun:
    """What one child process runs (its fields travel as JSON)."""

    fleet: str
    devices: int
    rounds: int
    fraction: float
    engine: str
    artifacts: str
    out: str
    epochs: int = 1
    lr: float = 0.01
    batch_size: int = 16
    split: str = "writers"
    hidden: int = 64
    seed: int = 0


@dataclass
class RoundCosts:
    """One round of one fleet (seconds and MB); `devices` is how many trained in it."""

    round: int
    devices: int
    wall_s: float
    setup_ms: float
    train_ms: float
    aggregate_ms: float
    checkpoint_ms: float
    peak_rss_mb: float
    accuracy: float


def timed(message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower mod: the device's whole ``train`` call and the worker's peak RSS, added to its reply's metrics."""
    started = time.perf_counter()
    reply = call_next(message, context)
    if not reply.has_error():
        record = reply.content.metric_records["metrics"]
        record["device_seconds"] = time.perf_counter() - started
        record["worker_peak_rss_mb"] = own_peak_rss_mb()
    return reply


class RecordingFedAvg(FedAvg):
    """Flower's FedAvg, keeping each round's per-device metrics (unweighted) before it aggregates."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.devices: dict[int, list[dict[str, float]]] = {}

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Record the replies' metrics, then aggregate as FedAvg does."""
        replies = list(replies)
        self.devices[server_round] = [dict(reply.content.metric_records["metrics"]) for reply in replies
                                      if not reply.has_error()]
        return super().aggregate_train(server_round, replies)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _costs(server: Any, strategy: RecordingFedAvg) -> list[RoundCosts]:
    rows = []
    for record in server.history:
        devices = strategy.devices.get(record.server_round, [])
        fits = [float(d["fit_seconds"]) for d in devices]
        calls = [float(d["device_seconds"]) for d in devices]
        rows.append(RoundCosts(
            round=record.server_round, devices=record.devices, wall_s=record.seconds,
            setup_ms=1e3 * _mean([c - f for c, f in zip(calls, fits, strict=True)]), train_ms=1e3 * _mean(fits),
            aggregate_ms=1e3 * record.aggregate_seconds, checkpoint_ms=1e3 * record.checkpoint_seconds,
            peak_rss_mb=max((float(d["worker_peak_rss_mb"]) for d in devices), default=float("nan")),
            accuracy=float(record.evaluation.get("accuracy", float("nan"))),
        ))
    return rows


def _fleet(run: FleetRun) -> tuple[Any, Any]:
    """The devices' ClientApp and the server's global model of `run.fleet`."""
    from ort_lightning.fleet.data.digits import DigitsPartitions

    data = DigitsPartitions(split=run.split, batch_size=run.batch_size, seed=run.seed)
    data(0, run.devices)  # NOTE: the digits' load and the writer groups are cached once per process, not a device's
    if run.fleet in ("ort", "ort-lightning"):
        import tempfile

        from ort_lightning.export import prepare_for_web
        from ort_lightning.fleet import DeviceClient, GlobalModel

        folder = prepare_for_web(run.artifacts, Path(tempfile.mkdtemp()) / "device", lr=run.lr)  # the devices' rate
        runner = "ort" if run.fleet == "ort" else "lightning"
        client = DeviceClient(folder.directory, data, epochs=run.epochs, runner=runner)
        return client.client_app(mods=[timed]), GlobalModel(run.artifacts)
    from benchmarks._fleet_torch import LightningTorchClient, TorchClient, TorchGlobalModel

    kind = LightningTorchClient if run.fleet == "lightning" else TorchClient
    torch_client = kind(data, epochs=run.epochs, lr=run.lr, hidden=run.hidden, seed=run.seed)
    return torch_client.client_app(mods=[timed]), TorchGlobalModel(run.hidden, run.seed)


def _run(run: FleetRun, server: Any, client_app: Any) -> None:
    from ort_lightning.fleet import run_local

    if run.engine == "local":
        run_local(server.server_app(), client_app, nodes=run.devices)
        return
    from flwr.simulation import run_simulation

    from ort_lightning.fleet.server.assembly import quiet_ray

    quiet_ray()
    backend = {"client_resources": {"num_cpus": 1.0, "num_gpus": 0.0}}
    run_simulation(server.server_app(), client_app, num_supernodes=run.devices, backend_config=backend)


def run_fleet(run: FleetRun) -> dict[str, Any]:
    """Run `run`'s rounds; write its final global values to ``out/final.pt``; return its per-round costs."""
    from ort_lightning.fleet import FleetServer
    from ort_lightning.fleet.data.digits import digits_test_loader
    from ort_lightning.fleet.devices.state_values import get_values

    for name in ("lightning.pytorch", "lightning.fabric", "flwr", "ray"):
        logging.getLogger(name).setLevel(logging.ERROR)
    random.seed(run.seed)  # NOTE: Flower's sample_nodes draws from `random`: every fleet samples the same devices
    client_app, model = _fleet(run)
    # NOTE: round 1 samples from every node (Ray registers its nodes while the first round starts); Flower's FedAvg
    # still sizes that sample from the nodes registered when the round begins, before it waits.
    strategy = RecordingFedAvg(fraction_train=run.fraction, fraction_evaluate=0.0, min_available_nodes=run.devices,
                               min_train_nodes=min(2, run.devices))
    out = Path(run.out)
    server = FleetServer(model, strategy, rounds=run.rounds, directory=out / "rounds",
                         test=digits_test_loader(run.seed))
    reset_peak_rss()
    started = time.perf_counter()
    with warnings.catch_warnings():  # NOTE: a Trainer per device and round warns that devices do not validate
        warnings.simplefilter("ignore")
        _run(run, server, client_app)
    total = time.perf_counter() - started
    values = get_values(model.module) if run.fleet in ("ort", "ort-lightning") else model.values()
    torch.save(values, out / "final.pt")
    return {"run": asdict(run), "seconds": total, "initial_accuracy": server.initial.get("accuracy"),
            "rounds": [asdict(row) for row in _costs(server, strategy)]}

