"""The fleet experiment people run: N simulated devices on the digits, R rounds, accuracy per round.

`FleetConfig` is the YAML file's content (``ort-lightning fleet --config fleet.yaml``);
`run_experiment` trains a digits classifier's artifacts on `devices` simulated
devices for `rounds` rounds with a Flower strategy, prints the global accuracy after each
round, and writes each round's ORT checkpoint, ``history.json`` and (with matplotlib)
``accuracy.png`` under `out`.

Every engine's devices run what a real device runs (``runner: ort``, `DeviceClient`): ONNX
Runtime's loop on the device folder ``out/device`` that `prepare_for_web` writes from the
artifacts (the optimizer graph computes the config's ``lr``), the very files a browser loads, so
that a simulated round equals a browser's round. ``runner: lightning`` runs a
``lightning.Trainer`` over an `ORTLightningModule` on each simulated device instead
(`FleetClient`): no device has a Trainer, and its epochs shuffle differently (`DeviceClient`).

``engine: local`` runs Flower's apps in this process (`run_local`: exact and fast on a few
cores); ``engine: simulation`` runs them on Flower's Ray simulation engine, the one that scales
to many machines; ``engine: browser`` serves a page whose visitors are the devices
(`ort_lightning.fleet.browser`: ``host``, ``port``, ``device_timeout``, ``ort_web``).

Example::

    >>> config = FleetConfig.from_dict({"devices": 3, "rounds": 1, "out": "runs/fleet"})
    >>> config.devices, config.strategy, config.split
    (3, 'fedavg', 'iid')
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedProx, FedYogi, Strategy

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.errors import ConfigurationError
from ort_lightning.export import prepare_for_web
from ort_lightning.fleet.app import DEVICE_TIMEOUT, FleetServer
from ort_lightning.fleet.client import OPTIMIZER_STATES, STARTS, FleetClient
from ort_lightning.fleet.device import DeviceClient
from ort_lightning.fleet.digits import SPLITS, DigitsPartitions, digits_test_loader
from ort_lightning.fleet.keys import check_keys, check_types, parse_override
from ort_lightning.fleet.local import run_local
from ort_lightning.fleet.server import GlobalModel

__all__ = [
    "ENGINES", "RUNNERS", "STRATEGIES", "FleetConfig", "device_folder", "fleet_client", "fleet_server", "report",
    "run_experiment",
]

#: Flower strategies by name (any other works through the Python API).
STRATEGIES: dict[str, type[Strategy]] = {
    "fedavg": FedAvg, "fedavgm": FedAvgM, "fedprox": FedProx, "fedadam": FedAdam, "fedyogi": FedYogi,
    "fedadagrad": FedAdagrad,
}
ENGINES = ("local", "simulation", "browser")
#: What a simulated device runs: ONNX Runtime's device loop (what a real device runs), or a Lightning Trainer.
RUNNERS = ("ort", "lightning")


@dataclass(frozen=True)
class FleetConfig:
    """One fleet experiment (the keys of the YAML file).

    Attributes:
        out: output folder (round checkpoints, history.json, accuracy.png; the console script's artifacts).
        devices: simulated devices (each one partition of the digits' training split).
        rounds: federated rounds.
        epochs: local epochs per round.
        lr: devices' learning rate (AdamW, constant).
        batch_size: devices' batch size.
        split: ``"iid"``, ``"label"`` (non-IID: each device holds one or two digits) or ``"writers"``
            (non-IID: each device holds the digits of one writer-like group; `DigitsPartitions`).
        strategy: a key of `STRATEGIES`.
        strategy_options: keyword arguments of that Flower strategy (``fraction_train``, ``eta``...).
        optimizer_state: ``"fresh"`` or ``"keep"`` (see `FleetClient`).
        start: where each device starts, ``"auto"``, ``"nominal"`` (the nominal checkpoint plus the
            server's values, as ONNX Runtime runs a device) or ``"complete"`` (see `FleetClient`).
        engine: ``"local"``, ``"simulation"`` (Flower's Ray engine) or ``"browser"`` (browsers that open the
            fleet's page are the devices, `ort_lightning.fleet.browser`).
        runner: what a simulated device runs: ``"ort"`` (ONNX Runtime's device loop on the device folder,
            what a phone or a page runs: `DeviceClient`) or ``"lightning"`` (a ``lightning.Trainer`` over an
            `ORTLightningModule`, `FleetClient`: not what a device runs).
        cpus_per_device: Ray CPUs per simulated device (``engine: simulation``).
        hidden: hidden units of the digits MLP (when the console script exports it).
        seed: seed of the model, the split and the shuffles.
        resume: a round checkpoint to continue from (its round number continues too).
        host: ``engine: browser``: the address the fleet's page is served on (loopback by default).
        port: ``engine: browser``: its port (0: a free one).
        device_timeout: seconds a device may take to answer a round; one that takes longer fails
            the round, which aggregates the others (``null``: no limit but Flower's hour).
        min_nodes: devices the server waits for before a round (the deployment runtime); 0 or
            ``null`` (the default) means ``devices - 1``, at least 1, so that a round goes on after
            one device is lost (0 is for Flower's run config, which has no null).
        ort_web: ``engine: browser``: onnxruntime-web's ``dist/`` folder or a URL (None: found as
            `ort_lightning.web.find_ort_web` finds it).
        page_data: ``engine: browser``: an ES module the pages import to make their own batches (the
            contract is in `ort_lightning.fleet.browser`), instead of the digits partitions; None: the
            server ships each page its digits partition.
        max_examples: ``engine: browser`` with ``page_data``: the most examples per epoch a page may claim.
    """

    out: str = "fleet-digits"
    devices: int = 10
    rounds: int = 5
    epochs: int = 1
    lr: float = 0.01
    batch_size: int = 16
    split: str = "iid"
    strategy: str = "fedavg"
    strategy_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    optimizer_state: str = "fresh"
    start: str = "auto"
    engine: str = "local"
    runner: str = "ort"
    cpus_per_device: float = 1.0
    hidden: int = 64
    seed: int = 0
    resume: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    device_timeout: float | None = DEVICE_TIMEOUT
    min_nodes: int | None = None
    ort_web: str | None = None
    page_data: str | None = None
    max_examples: int | None = None

    def __post_init__(self) -> None:
        checks = [("split", self.split, SPLITS), ("strategy", self.strategy, tuple(STRATEGIES)),
                  ("engine", self.engine, ENGINES), ("optimizer_state", self.optimizer_state, OPTIMIZER_STATES),
                  ("start", self.start, STARTS), ("runner", self.runner, RUNNERS)]
        for key, value, allowed in checks:
            if value not in allowed:
                raise ConfigurationError(
                    f"Expected `{key}` to be one of {list(allowed)}, but got {value!r}; fix that key of the fleet "
                    "config."
                )
        if self.engine == "browser" and self.optimizer_state == "keep":
            raise ConfigurationError(
                "Expected `optimizer_state: fresh` with `engine: browser`, but got \"keep\": a browser returns its "
                "weights only (onnxruntime-web saves no optimizer state); use engine: local or simulation to keep it."
            )
        if self.page_data is not None and self.engine != "browser":
            raise ConfigurationError(
                f"Expected `engine: browser` with `page_data`, but got engine {self.engine!r}: only browser pages "
                "import a data module; set engine: browser (or --browsers), or drop page_data."
            )
        if self.devices < 1 or self.rounds < 1 or self.epochs < 1:
            raise ConfigurationError(
                f"Expected devices, rounds and epochs >= 1, but got {self.devices}, {self.rounds}, {self.epochs}; "
                "fix those keys of the fleet config."
            )
        if self.device_timeout is not None and not self.device_timeout > 0:
            raise ConfigurationError(
                f"Expected `device_timeout` > 0 seconds or null (no limit), but got {self.device_timeout}; fix that "
                "key of the fleet config."
            )
        if self.min_nodes is not None and not 0 <= self.min_nodes <= self.devices:
            raise ConfigurationError(
                f"Expected `min_nodes` between 1 and devices ({self.devices}), or 0 or null for devices - 1, but got "
                f"{self.min_nodes}; fix that key of the fleet config, or leave it out (devices - 1, so that a round "
                "survives one lost device)."
            )

    @property
    def nodes_to_wait_for(self) -> int:
        """Devices a deployment's server waits for before a round: `min_nodes`, or one fewer than `devices`."""
        return self.min_nodes if self.min_nodes else max(1, self.devices - 1)

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, where: str = "the fleet config") -> FleetConfig:
        """Build from a mapping (the parsed YAML), its keys and their types checked.

        Raises:
            ConfigurationError: for a key that is not a `FleetConfig` field (with the closest one), or a
                value of the wrong type.
        """
        check_keys(values, cls, where=where)
        check_types(values, cls, where=where)
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, overrides: Sequence[str] = ()) -> FleetConfig:
        """Read a YAML file of `FleetConfig` keys, then apply ``KEY=VALUE`` `overrides` (``--set``) over it.

        Raises:
            ConfigurationError: for a file that is not a mapping, an unknown key or a value of the wrong
                type, in the file or in an override (which is named as such).
        """
        import yaml

        values = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if not isinstance(values, dict):
            raise ConfigurationError(f"Fleet config {path} must be a mapping of keys to values, got {type(values)}.")
        check_keys(values, cls, where=f"the fleet config {path}")
        check_types(values, cls, where=f"the fleet config {path}")
        changed = dict(parse_override(text) for text in overrides)
        return cls.from_dict({**values, **changed}, where="--set" if changed else f"the fleet config {path}")


def _strategy(config: FleetConfig) -> Strategy:
    options = {"fraction_evaluate": 0.0, "min_available_nodes": min(2, config.devices),
               "min_train_nodes": min(2, config.devices), **config.strategy_options}
    if config.strategy == "fedprox":
        options.setdefault("proximal_mu", 0.0)
    return STRATEGIES[config.strategy](**options)


def device_folder(config: FleetConfig, artifacts: str | os.PathLike[str]) -> TrainingArtifacts:
    """The folder every device of the experiment trains: ``out/device``, whose optimizer graph computes ``lr``.

    Written by `prepare_for_web` from `artifacts` (constant rate, ``.ort`` graphs, the nominal
    checkpoint): the files a browser loads, and the ones a simulated device opens.
    """
    return prepare_for_web(artifacts, Path(config.out) / "device", lr=config.lr)


def fleet_client(config: FleetConfig, artifacts: str | os.PathLike[str]) -> DeviceClient | FleetClient:
    """What each device of the experiment runs on the folder `artifacts`: its node's digits partition, the options.

    ``runner: ort`` runs ONNX Runtime's device loop (`DeviceClient`) at ``lr``: computed by the
    optimizer graph of a prepared folder (`device_folder`), set through ORT's ``set_learning_rate``
    on a plain one. ``runner: lightning`` runs a Trainer over an `ORTLightningModule` (`FleetClient`).
    """
    data = DigitsPartitions(split=config.split, batch_size=config.batch_size, seed=config.seed)
    kind = FleetClient if config.runner == "lightning" else DeviceClient
    return kind(Path(artifacts), data, epochs=config.epochs, lr=config.lr, optimizer_state=config.optimizer_state,
                start=config.start)


def fleet_server(config: FleetConfig, artifacts: str | os.PathLike[str]) -> FleetServer:
    """The experiment's server: its strategy and rounds, a checkpoint per round in ``out/rounds``, the test digits."""
    model = GlobalModel(Path(artifacts), checkpoint=config.resume)
    return FleetServer(model, _strategy(config), rounds=config.rounds, directory=Path(config.out) / "rounds",
                       test=digits_test_loader(config.seed), device_timeout=config.device_timeout)


def _run(server: FleetServer, client: DeviceClient | FleetClient, config: FleetConfig) -> None:
    if config.engine == "local":
        run_local(server.server_app(), client.client_app(), nodes=config.devices)
        return
    from flwr.simulation import run_simulation

    quiet_ray()
    # NOTE: the actors' own log lines (Flower's "Manually terminating ClientAppActor" at the end of each run) stay in
    # the actors: a device's failure reaches the server as its error reply, which the round line names.
    backend: dict[str, Any] = {"client_resources": {"num_cpus": config.cpus_per_device, "num_gpus": 0.0},
                               "init_args": {"log_to_driver": False}}
    run_simulation(server.server_app(), client.client_app(), num_supernodes=config.devices, backend_config=backend)


def quiet_ray() -> None:
    """Tell Ray what its start-up ``FutureWarning`` asks for, so that the Ray engine prints the round lines alone.

    Ray 2.55 warns at start-up that it will stop overriding ``CUDA_VISIBLE_DEVICES`` for actors with
    ``num_gpus=0``; the devices ask for no GPU, so the future behaviour is the one wanted. A value the
    user set stays.
    """
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")


def run_experiment(config: FleetConfig, artifacts: str | os.PathLike[str], *, echo: bool = True) -> FleetServer:
    """Run the experiment; print accuracy per round (when `echo`); write history.json and accuracy.png.

    Args:
        config: the experiment.
        artifacts: artifacts of a digits classifier (64 float inputs, 10 classes), e.g. from
            ``export_artifacts(digits_mlp(), torch.zeros(2, 64), folder)``.
        echo: print the accuracy per round.

    Returns:
        The `FleetServer`, whose ``history`` holds each round's record.
    """
    Path(config.out).mkdir(parents=True, exist_ok=True)
    if config.engine == "browser":
        from ort_lightning.fleet.browser.experiment import run_browser_experiment

        return run_browser_experiment(config, artifacts, echo=echo)
    server = fleet_server(config, artifacts)
    devices = device_folder(config, artifacts).directory if config.runner == "ort" else artifacts
    started = time.perf_counter()
    _run(server, fleet_client(config, devices), config)
    report(server, config, time.perf_counter() - started, echo=echo)
    return server


def report(server: FleetServer, config: FleetConfig, total: float, *, echo: bool = True, engine: str = "") -> None:
    """Print the accuracy per round (when `echo`); write ``history.json`` and ``accuracy.png`` under ``out``.

    `engine` names where the rounds ran in the printed header (the config's engine when empty).
    """
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    if echo:
        _print(server, config, total, engine or f"{config.engine} engine")
    _write_history(server, config, out, total)
    plot = _plot(server, config, out)
    if echo:
        print(f"round checkpoints: {out / 'rounds'}")
        print(f"history:           {out / 'history.json'}")
        print(f"plot:              {plot if plot else 'not written (pip install matplotlib)'}")


def _print(server: FleetServer, config: FleetConfig, total: float, engine: str) -> None:
    print(f"{config.devices} devices, {config.split} split, {config.strategy}, {engine}")
    if server.initial:
        print(f"round  0: accuracy {server.initial['accuracy']:.2%}  loss {server.initial['loss']:.4f}")
    for record in server.history:
        print(f"round {record.server_round:2d}: accuracy {record.evaluation.get('accuracy', float('nan')):.2%}  "
              f"loss {record.evaluation.get('loss', float('nan')):.4f}  ({record.seconds:.2f} s; {record.devices} "
              f"devices, {_device_times(record.train_metrics)}, {record.aggregate_seconds * 1e3:.1f} ms aggregate, "
              f"{record.checkpoint_seconds * 1e3:.1f} ms checkpoint)")
        for node, reason in sorted(record.failures.items()):
            print(f"          node {node} failed: {reason}")
    print(f"total: {total:.1f} s")


def _device_times(metrics: dict[str, Any]) -> str:
    """A round's mean device timings: the local fit, the set-up before it, the loop's steps per second."""
    nan = float("nan")
    fit, setup = metrics.get("fit_seconds", nan), metrics.get("setup_seconds", nan)
    return (f"{fit * 1e3:.1f} ms mean local fit, {setup * 1e3:.2f} ms set-up, "
            f"{metrics.get('steps_per_second', nan):.0f} steps/s")


def _write_history(server: FleetServer, config: FleetConfig, out: Path, total: float) -> None:
    rounds = [{"round": r.server_round, "seconds": r.seconds, "aggregate_seconds": r.aggregate_seconds,
               "checkpoint_seconds": r.checkpoint_seconds, "devices": r.devices, "examples": r.examples,
               "failures": {str(node): reason for node, reason in r.failures.items()},
               **r.evaluation, "train": r.train_metrics,
               "checkpoint": None if r.checkpoint is None else str(r.checkpoint)} for r in server.history]
    payload = {"config": dataclasses.asdict(config), "initial": server.initial, "rounds": rounds, "seconds": total}
    (out / "history.json").write_text(json.dumps(payload, indent=2), encoding="utf-8")


def _plot(server: FleetServer, config: FleetConfig, out: Path) -> Path | None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    points = [(0, server.initial.get("accuracy"))] + [(r.server_round, r.evaluation.get("accuracy"))
                                                     for r in server.history]
    xs = [x for x, y in points if y is not None]
    ys = [y for _, y in points if y is not None]
    # NOTE: a Figure without pyplot: the caller's matplotlib backend (a notebook's inline one) stays as it was.
    figure = Figure(figsize=(5, 3.5))
    axes = figure.subplots()
    axes.plot(xs, ys, marker="o")
    axes.set(xlabel="round", ylabel="global accuracy (held-out digits)", ylim=(0, 1),
             title=f"{config.devices} devices, {config.split}, {config.strategy}")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = out / "accuracy.png"
    figure.savefig(path, dpi=100)
    return path
