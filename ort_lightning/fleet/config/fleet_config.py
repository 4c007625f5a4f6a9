"""`FleetConfig`: one fleet run in sections: model, data, devices, strategy, privacy, engine, output.

The YAML of ``ort-lightning fleet --config``, the mapping `ort_lightning.fleet.run_fleet` takes and
Flower's run config of the deployment app are this one shape; docs/fleets.md lists every key.

Example::

    >>> config = FleetConfig.from_dict({"devices": {"count": 3}, "rounds": 1, "output": {"folder": "runs/fleet"}})
    >>> config.devices.count, config.strategy.name, config.data.partition
    (3, 'fedavg', 'iid')
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.config.keys import build_section, merge_override, refuse_flat_keys
from ort_lightning.fleet.devices.protocol import DEVICE_TIMEOUT, OPTIMIZER_STATES, RUNNERS, STARTS

__all__ = [
    "ENGINES", "LORA_AGGREGATIONS", "PARTITIONS", "ROBUST", "RUNNERS", "STRATEGIES", "DataSection", "DevicesSection",
    "EngineSection", "FleetConfig",
    "ModelSection", "OutputSection", "PrivacySection", "SecAggSection", "StrategySection",
]

#: Flower strategies the config names (lower-case class names of ``flwr.serverapp.strategy``).
STRATEGIES = ("fedavg", "fedavgm", "fedprox", "fedadam", "fedyogi", "fedadagrad", "qfedavg", "fedmedian",
              "fedtrimmedavg", "krum", "multikrum", "bulyan")
#: Strategies that weigh each device's update on its own, which secure aggregation hides from the server.
ROBUST = ("fedmedian", "fedtrimmedavg", "krum", "multikrum", "bulyan", "qfedavg")
#: ``local``: Flower's apps in this process; ``ray``: Flower's Ray simulation; ``browser``: pages and Node devices.
ENGINES = ("local", "ray", "browser")
#: How a fleet aggregates LoRA adapters: A and B apart, or A frozen and B alone (ort_lightning.fleet.server.lora).
LORA_AGGREGATIONS = ("separate", "ffa")
#: How the training data is cut into devices (``writers``: the bundled digits only; ``ordered``: contiguous blocks).
PARTITIONS = ("iid", "label", "dirichlet", "ordered", "writers")


def _one_of(key: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ConfigurationError(f"Expected `{key}` to be one of {list(allowed)}, but got {value!r}; fix that key "
                                 "of the fleet config.")


def _check_own_loss(model: ModelSection) -> None:
    """A model that computes its own loss takes its labels as an input: its example input is the data's rows."""
    if model.loss is None and model.input_shape is not None:
        raise ConfigurationError(
            f"Expected `model.input_shape` null with `model.loss: null` (the model's own loss), but got "
            f"{model.input_shape}: such a model takes its labels as an input, so its example input is the data's "
            "first rows (inputs and labels); drop input_shape and name the inputs with model.input_names.")


@dataclass(frozen=True)
class ModelSection:
    """What the fleet trains: the bundled digits MLP (``hidden`` wide), a torch module ``factory``, or ``artifacts``.

    ``factory`` is ``package.module:function`` called with ``init_args``; it is exported once with an
    example input of ``input_shape`` (float32; None: the data's first two rows, their dtypes kept)
    and ``loss`` (null: the model's own, with the labels among its inputs, named by ``input_names``),
    one step checked against torch in a child process unless ``verify`` is false.
    ``artifacts`` is a folder `export_artifacts` wrote with ``nominal_checkpoint=True``. ``lora`` is
    how a peft LoRA model's adapters are aggregated: ``separate`` or ``ffa`` (A frozen, exact).
    """

    hidden: int = 64
    factory: str | None = None
    init_args: dict[str, Any] = field(default_factory=dict)
    input_shape: list[int] | None = None
    input_names: list[str] | None = None
    loss: str | None = "cross_entropy"
    verify: bool = True
    artifacts: str | None = None
    lora: str = "separate"

    def __post_init__(self) -> None:
        _one_of("model.lora", self.lora, LORA_AGGREGATIONS)
        if self.factory and self.artifacts:
            raise ConfigurationError(f"Expected one of `model.factory` and `model.artifacts`, but got both "
                                     f"({self.factory!r}, {self.artifacts!r}); keep the one the fleet trains.")
        _check_own_loss(self)


@dataclass(frozen=True)
class DataSection:
    """The devices' data: a LightningDataModule by import path (None: the bundled digits), cut per device.

    ``class_path`` (``package.module:Class`` or ``package.module.Class``) is built with ``init_args``;
    its training set is cut into ``partition`` parts (Dirichlet with ``alpha``) and its validation
    set (else its test set) measures the global model after each round.
    """

    class_path: str | None = None
    init_args: dict[str, Any] = field(default_factory=dict)
    partition: str = "iid"
    alpha: float = 0.5

    def __post_init__(self) -> None:
        _one_of("data.partition", self.partition, PARTITIONS)
        if self.partition == "writers" and self.class_path:
            raise ConfigurationError("Expected `data.partition: writers` with the bundled digits only, but got a "
                                     f"data module ({self.class_path}); use iid, label or dirichlet.")
        if not self.alpha > 0:
            raise ConfigurationError(f"Expected `data.alpha` > 0, but got {self.alpha}; smaller is more skewed.")


@dataclass(frozen=True)
class DevicesSection:
    """The devices: how many, what each runs, its local training and how long it may take."""

    count: int = 10
    runner: str = "ort"
    epochs: int = 1
    lr: float = 0.01
    batch_size: int = 16
    optimizer_state: str = "fresh"
    start: str = "auto"
    timeout: float | None = DEVICE_TIMEOUT
    min_nodes: int | None = None
    cpus: float = 1.0

    def __post_init__(self) -> None:
        _one_of("devices.runner", self.runner, RUNNERS)
        _one_of("devices.optimizer_state", self.optimizer_state, OPTIMIZER_STATES)
        _one_of("devices.start", self.start, STARTS)
        if self.count < 1 or self.epochs < 1 or self.batch_size < 1:
            raise ConfigurationError(f"Expected devices.count, devices.epochs and devices.batch_size >= 1, but got "
                                     f"{self.count}, {self.epochs}, {self.batch_size}; fix those keys.")
        if self.timeout is not None and not self.timeout > 0:
            raise ConfigurationError(f"Expected `devices.timeout` > 0 seconds or null (no limit), but got "
                                     f"{self.timeout}; fix that key of the fleet config.")
        if self.min_nodes is not None and not 0 <= self.min_nodes <= self.count:
            raise ConfigurationError(f"Expected `devices.min_nodes` between 1 and devices.count ({self.count}), or 0 "
                                     f"or null for count - 1, but got {self.min_nodes}; fix it or leave it out.")


@dataclass(frozen=True)
class StrategySection:
    """A Flower strategy by name and its keyword arguments."""

    name: str = "fedavg"
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _one_of("strategy.name", self.name, STRATEGIES)


@dataclass(frozen=True)
class PrivacySection:
    """Flower's differential privacy around the strategy, clipped on the ``client`` or ``server`` side (null: off).

    The other keys are the arguments of Flower's DP wrapper for that side and clipping (null: its
    default): ``clipping_norm`` for fixed clipping, ``initial_clipping_norm`` and the rest for adaptive.
    """

    side: str | None = None
    clipping: str = "fixed"
    noise_multiplier: float | None = None
    clipping_norm: float | None = None
    initial_clipping_norm: float | None = None
    target_clipped_quantile: float | None = None
    clip_norm_lr: float | None = None
    clipped_count_stddev: float | None = None
    num_sampled_clients: int | None = None

    def __post_init__(self) -> None:
        _one_of("privacy.side", self.side, (None, "client", "server"))
        _one_of("privacy.clipping", self.clipping, ("fixed", "adaptive"))

    def wrapper(self) -> dict[str, Any] | None:
        """The keys set, as the strategies take them (None: no differential privacy)."""
        if self.side is None:
            return None
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


def _check_secure(strategy: str, privacy: str | None) -> None:
    """Refuse what secure aggregation cannot serve: it shows the server the sum of the updates, never one of them."""
    if strategy in ROBUST:
        raise ConfigurationError(
            f"Strategy {strategy} cannot run with `secagg.enabled: true`: it needs each device's own update (to rank, "
            "trim or weigh them), and secure aggregation shows the server only their sum; use strategy fedavg, or "
            "turn secagg off."
        )
    if strategy != "fedavg":
        raise ConfigurationError(
            f"Expected `strategy.name: fedavg` with `secagg.enabled: true`, but got {strategy!r}: secure aggregation "
            "runs Flower's legacy FedAvg under its SecAggPlusWorkflow; use fedavg, or turn secagg off."
        )
    if privacy == "server":
        raise ConfigurationError(
            "Expected `privacy.side: client` (or null) with `secagg.enabled: true`, but got \"server\": server-side "
            "clipping clips each device's update, which secure aggregation hides; clip on the devices (side: client)."
        )


@dataclass(frozen=True)
class SecAggSection:
    """Flower's SecAgg+ (``SecAggPlusWorkflow``): the server sees the sum of the updates only (off unless ``enabled``).

    The other keys are the workflow's arguments, Flower's defaults but for ``num_shares`` and
    ``reconstruction_threshold``, which Flower leaves to the caller (an int counts devices, a
    float is a fraction of the sampled devices, as in Flower).
    """

    enabled: bool = False
    num_shares: int | float = 3
    reconstruction_threshold: int | float = 2
    max_weight: float = 1000.0
    clipping_range: float = 8.0
    quantization_range: int = 4194304
    modulus_range: int = 4294967296
    timeout: float | None = None

    def workflow(self) -> dict[str, Any]:
        """The keyword arguments of Flower's ``SecAggPlusWorkflow``."""
        return {key: value for key, value in dataclasses.asdict(self).items() if key != "enabled"}


@dataclass(frozen=True)
class EngineSection:
    """Where the rounds run; the rest are the browser engine's page, TLS and join options."""

    name: str = "local"
    host: str = "127.0.0.1"
    port: int = 8000
    ort_web: str | None = None
    page_data: str | None = None
    max_examples: int | None = None
    min_devices: int | None = None
    wait_timeout: float | None = 600.0
    certfile: str | None = None
    keyfile: str | None = None
    token: str | None = None

    def __post_init__(self) -> None:
        _one_of("engine.name", self.name, ENGINES)
        if self.page_data is not None and self.name != "browser":
            raise ConfigurationError(f"Expected `engine.name: browser` with `engine.page_data`, but got engine "
                                     f"{self.name!r}: only browser pages import a data module; set engine.name: "
                                     "browser (or --browsers), or drop page_data.")


@dataclass(frozen=True)
class OutputSection:
    """Where the run writes (artifacts, round checkpoints, history.json, the plot) and what it resumes from.

    ``pretrained`` also writes the last round as the ``save_pretrained`` folder of the transformers or
    peft model the artifacts were exported from (``folder/pretrained``: a peft model's adapter folder).
    """

    folder: str = "fleet-digits"
    resume: str | None = None
    plot: bool = True
    pretrained: bool = False


@dataclass(frozen=True)
class FleetConfig:
    """One fleet run: ``rounds`` of the strategy, ``seed`` of the model, the partition and the shuffles."""

    rounds: int = 5
    seed: int = 0
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    devices: DevicesSection = field(default_factory=DevicesSection)
    strategy: StrategySection = field(default_factory=StrategySection)
    privacy: PrivacySection = field(default_factory=PrivacySection)
    secagg: SecAggSection = field(default_factory=SecAggSection)
    engine: EngineSection = field(default_factory=EngineSection)
    output: OutputSection = field(default_factory=OutputSection)

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ConfigurationError(f"Expected `rounds` >= 1, but got {self.rounds}; fix that key.")
        if self.engine.name == "browser" and self.devices.optimizer_state == "keep":
            raise ConfigurationError(
                "Expected `devices.optimizer_state: fresh` with `engine.name: browser`, but got \"keep\": a browser "
                "returns its weights only (onnxruntime-web saves no optimizer state); use engine local or ray to keep "
                "it."
            )
        if self.secagg.enabled:
            _check_secure(self.strategy.name, self.privacy.side)

    @property
    def nodes_to_wait_for(self) -> int:
        """Devices a deployment's server waits for before a round: ``min_nodes``, or one fewer than ``count``."""
        return self.devices.min_nodes or max(1, self.devices.count - 1)

    def replace(self, **changes: Any) -> FleetConfig:
        """A copy with keys changed, a section's mapping merged into it (``config.replace(engine={"name": "ray"})``)."""
        values = dataclasses.asdict(self)
        for key, change in changes.items():
            values[key] = {**values[key], **change} if isinstance(change, Mapping) else change
        return FleetConfig.from_dict(values)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, where: str = "the fleet config") -> FleetConfig:
        """Build from a mapping of sections, every key and type checked at any depth.

        Raises:
            ConfigurationError: for a key of the flat form (naming its new key), an unknown key (with the
                choices) or a value of the wrong type.
        """
        if not isinstance(values, Mapping):
            raise ConfigurationError(f"Expected {where} to be a mapping of sections, but got {type(values).__name__}.")
        refuse_flat_keys(values, where=where)
        return build_section(cls, values, where=where)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str], *, overrides: Sequence[str] = ()) -> FleetConfig:
        """Read a YAML file of sections, then apply ``KEY=VALUE`` `overrides` (``--set devices.count=3``)."""
        import yaml

        values = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        if not isinstance(values, dict):
            raise ConfigurationError(f"Fleet config {path} must be a mapping of keys to values, got {type(values)}.")
        cls.from_dict(values, where=f"the fleet config {path}")
        for text in overrides:
            values = merge_override(values, text)
        return cls.from_dict(values, where="--set")
