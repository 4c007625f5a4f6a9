"""Every strategy of Flower's Message API from the config's ``strategy`` and ``privacy`` sections, checked first.

`strategy_from` builds the Flower strategy a fleet runs: one of `STRATEGIES` with the fleet's
defaults (`fleet_defaults`, the one place they are written), wrapped in Flower's central
differential privacy (`PRIVACY`) when a privacy section is given. A combination that cannot
work is refused here, before any device starts, in one line naming why.

Example::

    >>> strategy = strategy_from({"name": "krum", "options": {}}, None, devices=5)
    >>> type(strategy).__name__, strategy.num_malicious_nodes, strategy.min_train_nodes
    ('Krum', 1, 5)
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from flwr.serverapp.strategy import (
    Bulyan,
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    MultiKrum,
    QFedAvg,
    Strategy,
)

from ort_lightning.errors import ConfigurationError

__all__ = ["PRIVACY", "STRATEGIES", "fleet_defaults", "strategy_from"]

#: Flower's Message-API strategies by the name the config's ``strategy.name`` gives (the XGBoost ones aside).
STRATEGIES: dict[str, type[Strategy]] = {
    "fedavg": FedAvg, "fedavgm": FedAvgM, "fedprox": FedProx, "fedadam": FedAdam, "fedyogi": FedYogi,
    "fedadagrad": FedAdagrad, "qfedavg": QFedAvg, "fedmedian": FedMedian, "fedtrimmedavg": FedTrimmedAvg,
    "krum": Krum, "multikrum": MultiKrum, "bulyan": Bulyan,
}
#: Flower's differential privacy wrappers by the privacy section's ``side`` and ``clipping``.
PRIVACY: dict[tuple[str, str], type[Strategy]] = {
    ("client", "fixed"): DifferentialPrivacyClientSideFixedClipping,
    ("client", "adaptive"): DifferentialPrivacyClientSideAdaptiveClipping,
    ("server", "fixed"): DifferentialPrivacyServerSideFixedClipping,
    ("server", "adaptive"): DifferentialPrivacyServerSideAdaptiveClipping,
}
#: Constructor arguments the fleet sets itself: the devices' record keys, functions, the wrapped strategy.
_FIXED = {"self", "strategy", "accountant", "weighted_by_key", "arrayrecord_key", "configrecord_key",
          "train_loss_key", "train_metrics_aggr_fn", "evaluate_metrics_aggr_fn", "selection_rule"}
#: Strategies that assume `num_malicious_nodes` Byzantine devices, and the replies each needs for f of them.
_BYZANTINE = {"krum": (2, 3), "multikrum": (2, 3), "bulyan": (4, 3)}
#: Flower's warnings about choices the fleet makes on purpose (no federated evaluation; FedProx's mu of 0).
_QUIET = ("fraction_evaluate is set to 0.0", "FedProx initialized with `proximal_mu=0.0`")


def fleet_defaults(name: str, devices: int, *, min_nodes: int | None = None, lr: float | None = None) -> dict[str, Any]:
    """The fleet's options for strategy `name` on `devices` devices; the config's own options go over them.

    Args:
        name: a key of `STRATEGIES`.
        devices: the fleet's devices.
        min_nodes: devices a round waits for (a deployment: ``devices - 1``); None: 2, or 1 alone.
        lr: the devices' learning rate (QFedAvg's ``client_learning_rate``).
    """
    floor = min(2, devices) if min_nodes is None else min_nodes
    # NOTE: the server evaluates the global model on its own test data; devices need none.
    options: dict[str, Any] = {"fraction_evaluate": 0.0, "min_available_nodes": floor, "min_train_nodes": floor}
    if name == "fedprox":
        options["proximal_mu"] = 0.0
    if name == "qfedavg" and lr is not None:
        options["client_learning_rate"] = lr
    if name in _BYZANTINE:
        # NOTE: Flower's default of 0 Byzantine devices makes Bulyan a plain mean; the fleet assumes one.
        options["num_malicious_nodes"] = 1
    return options


def strategy_from(
    strategy: Mapping[str, Any], privacy: Mapping[str, Any] | None, devices: int, *,
    min_nodes: int | None = None, lr: float | None = None,
) -> Strategy:
    """The Flower strategy of the config's ``strategy`` section, wrapped in its ``privacy`` section's DP, if any.

    Args:
        strategy: ``{"name": "fedavg", "options": {...}}``: a key of `STRATEGIES` and that Flower
            strategy's keyword arguments (over `fleet_defaults`).
        privacy: None, or ``{"side": "client" | "server", "clipping": "fixed" | "adaptive", ...}`` with
            the keyword arguments of that wrapper of `PRIVACY` (``noise_multiplier``, ``clipping_norm``,
            ``num_sampled_clients``...). ``side: client`` needs the devices to clip
            (`ort_lightning.fleet.devices.clipping.clipping_mods`).
        devices: the fleet's devices.
        min_nodes: devices a round waits for (see `fleet_defaults`).
        lr: the devices' learning rate (QFedAvg's default ``client_learning_rate``).

    Raises:
        ConfigurationError: for an unknown name or option, a value of the wrong type, or a combination
            that cannot work (too few devices for the strategy's Byzantine devices, more sampled
            clients than devices, ...), in one line naming why.
    """
    if devices < 1:
        raise ConfigurationError(f"Expected at least 1 device, but got {devices}; set the fleet's devices.")
    if set(strategy) - {"name", "options"}:
        raise ConfigurationError(f"Unknown key(s) {sorted(set(strategy) - {'name', 'options'})} in the strategy "
                                 "section; it takes `name` and `options` (Flower's keyword arguments).")
    name = str(strategy.get("name", "fedavg")).lower()
    kind = _choose(STRATEGIES, name, "strategy name")
    given = dict(strategy.get("options") or {})
    _check_options(kind, given, f"strategy {name}")
    options = {**fleet_defaults(name, devices, min_nodes=min_nodes, lr=lr), **given}
    _check_strategy(name, options, devices, floor_given="min_train_nodes" in given)
    built = _build(kind, options, f"strategy {name}")
    return built if privacy is None else _private(built, privacy, _sampled(options, devices), devices)


def _choose(table: Mapping[Any, type[Strategy]], key: Any, what: str) -> type[Strategy]:
    if key not in table:
        choices = sorted(table) if what == "strategy name" else [f"{side}/{clip}" for side, clip in table]
        raise ConfigurationError(f"Unknown {what} {key!r}; choose one of {choices}.")
    return table[key]


def _settable(kind: type[Strategy]) -> dict[str, Any]:
    """The constructor arguments of `kind` a config may set, with their type hints."""
    hints = typing.get_type_hints(kind.__init__)
    names = inspect.signature(kind.__init__).parameters
    return {name: hints.get(name, Any) for name in names if name not in _FIXED}


def _check_options(kind: type[Strategy], given: Mapping[str, Any], where: str) -> None:
    """Refuse an option `kind` does not take, or a value of the wrong type, naming the choices."""
    settable = _settable(kind)
    for key, value in given.items():
        if key not in settable:
            raise ConfigurationError(f"Unknown option `{key}` for {where} (Flower's {kind.__name__}); "
                                     f"its options are {sorted(settable)}.")
        accepted = _accepted(settable[key])
        if accepted and not _matches(value, accepted):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in accepted)
            raise ConfigurationError(f"Expected option `{key}` of {where} to be {names}, but got {value!r}; fix it "
                                     "in the config.")


def _accepted(hint: Any) -> tuple[type, ...]:
    """The plain classes a hint allows (``float | None`` -> float, NoneType); () for anything else."""
    parts = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    plain = tuple(part for part in parts if part in (int, float, str, bool, type(None)))
    return plain if len(plain) == len(parts) else ()


def _matches(value: Any, accepted: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in accepted
    if isinstance(value, int) and float in accepted:
        return True
    return isinstance(value, accepted)


def _check_strategy(name: str, options: dict[str, Any], devices: int, *, floor_given: bool) -> None:
    """Refuse what cannot work on `devices` devices (see `strategy_from`)."""
    for key in ("min_available_nodes", "min_train_nodes"):
        if options[key] > devices:
            raise ConfigurationError(f"Option `{key}` of strategy {name} is {options[key]}, above the fleet's "
                                     f"{devices} devices: every round would wait for ever; lower it or add devices.")
    if name == "fedprox" and options["proximal_mu"] != 0:
        raise ConfigurationError(f"Strategy fedprox with proximal_mu={options['proximal_mu']} needs devices that add "
                                 "the proximal term to their loss, and the exported training graph has none; use "
                                 "proximal_mu: 0 (FedAvg) or another strategy.")
    if name == "qfedavg" and "client_learning_rate" not in options:
        raise ConfigurationError("Strategy qfedavg needs `client_learning_rate` (the devices' learning rate, its "
                                 "Lipschitz estimate); set it in the strategy's options.")
    beta = options.get("beta", 0.2)
    if name == "fedtrimmedavg" and beta > 0 and int(beta * devices) == 0:
        raise ConfigurationError(f"Strategy fedtrimmedavg with beta={beta} over {devices} devices cuts "
                                 f"int({beta} * {devices}) = 0 replies at each end, a plain mean; raise beta to "
                                 f"at least {1 / devices:.3g} (below 0.5), or add devices.")
    if name in _BYZANTINE:
        _check_byzantine(name, options, devices, floor_given=floor_given)


def _check_byzantine(name: str, options: dict[str, Any], devices: int, *, floor_given: bool) -> None:
    """Krum, MultiKrum and Bulyan: enough devices for `num_malicious_nodes` f; each round waits for them."""
    f = options["num_malicious_nodes"]
    times, plus = _BYZANTINE[name]
    need = times * f + plus
    if f < 0 or devices < need:
        raise ConfigurationError(f"Strategy {name} with num_malicious_nodes={f} needs at least {times}f+{plus} = "
                                 f"{need} devices, but the fleet has {devices}; add devices or lower "
                                 "num_malicious_nodes.")
    if floor_given and options["min_train_nodes"] < need:
        raise ConfigurationError(f"Strategy {name} with num_malicious_nodes={f} aggregates {need} replies or more, "
                                 f"but min_train_nodes is {options['min_train_nodes']}; raise it to {need} or leave "
                                 "it out.")
    options["min_train_nodes"] = max(options["min_train_nodes"], need)
    options["min_available_nodes"] = max(options["min_available_nodes"], need)
    if name == "multikrum":
        options.setdefault("num_nodes_to_select", devices - f)
        if not 1 <= options["num_nodes_to_select"] <= devices - f:
            raise ConfigurationError(f"Strategy multikrum selects num_nodes_to_select={options['num_nodes_to_select']}"
                                     f" replies, but between 1 and devices - f = {devices - f} can be honest; "
                                     "choose one in that range.")


def _sampled(options: Mapping[str, Any], devices: int) -> int:
    """The devices the strategy samples per round, when all are connected (Flower's FedAvg sampling)."""
    return min(devices, max(int(devices * options.get("fraction_train", 1.0)), options["min_train_nodes"]))


def _private(inner: Strategy, privacy: Mapping[str, Any], sampled: int, devices: int) -> Strategy:
    """`inner` in the Flower DP wrapper that the privacy section names."""
    values = dict(privacy)
    side, clipping = values.pop("side", None), values.pop("clipping", "fixed")
    kind = _choose(PRIVACY, (side, clipping), "privacy side/clipping")
    where = f"privacy {side}/{clipping}"
    _check_options(kind, values, where)
    values.setdefault("num_sampled_clients", sampled)
    required = [name for name, parameter in inspect.signature(kind.__init__).parameters.items()
                if parameter.default is inspect.Parameter.empty and name not in _FIXED and name not in values]
    if required:
        raise ConfigurationError(f"The {where} section needs {required} (Flower's {kind.__name__} has no default); "
                                 "set them in the privacy section.")
    if not 1 <= values["num_sampled_clients"] <= devices:
        raise ConfigurationError(f"The {where} section's num_sampled_clients={values['num_sampled_clients']} is "
                                 f"not between 1 and the fleet's {devices} devices; the noise is scaled for that many "
                                 f"replies per round (leave it out: {sampled}, the devices each round samples).")
    return _build(kind, {"strategy": inner, **values}, where)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Drop Flower's warnings about the choices the fleet makes on purpose (`_QUIET`) while a strategy is built."""
    logger = logging.getLogger("flwr")

    def keep(record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and record.getMessage().startswith(_QUIET))

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def _build(kind: type[Strategy], options: Mapping[str, Any], where: str) -> Strategy:
    """``kind(**options)``, Flower's own refusal of a value told in one line."""
    try:
        with _quiet():
            return kind(**options)
    except ValueError as error:
        raise ConfigurationError(f"Flower's {kind.__name__} refused the {where} options: {error} Fix them in the "
                                 "config.") from error
