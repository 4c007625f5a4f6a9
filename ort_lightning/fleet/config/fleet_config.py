"""`FleetConfig`: one fleet experiment, the keys of its YAML file (``ort-lightning fleet --config fleet.yaml``).

Example::

    >>> config = FleetConfig.from_dict({"devices": 3, "rounds": 1, "out": "runs/fleet"})
    >>> config.devices, config.strategy, config.split
    (3, 'fedavg', 'iid')
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvg, FedAvgM, FedProx, FedYogi, Strategy

from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.config.keys import check_keys, check_types, parse_override
from ort_lightning.fleet.data.digits import SPLITS
from ort_lightning.fleet.devices.protocol import DEVICE_TIMEOUT, OPTIMIZER_STATES, RUNNERS, STARTS

__all__ = ["ENGINES", "RUNNERS", "STRATEGIES", "FleetConfig"]

#: Flower strategies by name (any other works through the Python API).
STRATEGIES: dict[str, type[Strategy]] = {
    "fedavg": FedAvg, "fedavgm": FedAvgM, "fedprox": FedProx, "fedadam": FedAdam, "fedyogi": FedYogi,
    "fedadagrad": FedAdagrad,
}
ENGINES = ("local", "simulation", "browser")


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
        optimizer_state: ``"fresh"`` or ``"keep"`` (see `DeviceClient`).
        start: where each device starts, ``"auto"``, ``"nominal"`` (the nominal checkpoint plus the
            server's values, as ONNX Runtime runs a device) or ``"complete"`` (see `DeviceClient`).
        engine: ``"local"``, ``"simulation"`` (Flower's Ray engine) or ``"browser"`` (browsers that open the
            fleet's page are the devices, `ort_lightning.fleet.engines.browser`).
        runner: what a simulated device runs: ``"ort"`` (ONNX Runtime's device loop on the device folder,
            what a phone or a page runs) or ``"lightning"`` (a ``lightning.Trainer`` over an
            `ORTLightningModule`: not what a device runs); see `DeviceClient`.
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
            contract is in `ort_lightning.fleet.engines.browser`), instead of the digits partitions; None: the
            server ships each page its digits partition.
        max_examples: ``engine: browser`` with ``page_data``: the most examples per epoch a page may claim.
        min_devices: ``engine: browser``: the pages the first round waits for (None: ``devices``, which is
            the most connected at once); later rounds sample among the pages connected then.
        wait_timeout: ``engine: browser``: seconds to wait while fewer pages than the strategy's minimum
            are connected before the run stops (null: no limit).
        certfile: ``engine: browser``: a PEM certificate to serve HTTPS and WSS with (with ``keyfile``).
        keyfile: ``engine: browser``: the certificate's PEM private key.
        token: ``engine: browser``: the join token (None: a random one); a run restarted with ``resume`` and the
            token it printed takes its pages back as they reconnect.
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
    min_devices: int | None = None
    wait_timeout: float | None = 600.0
    certfile: str | None = None
    keyfile: str | None = None
    token: str | None = None

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
