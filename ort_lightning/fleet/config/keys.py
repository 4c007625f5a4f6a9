"""The keys of a sectioned config: checked at any depth, ``--set a.b=VALUE`` merged, the flat form named.

Pure functions over nested dataclasses: `build_section` refuses an unknown key with the closest
one and the choices (``strategy.optons``), and a value of the wrong type, before anything starts.

Example::

    >>> parse_override("devices.count=3")
    ('devices.count', 3)
    >>> merge_override({"devices": {"lr": 0.1}}, "devices.count=3")
    {'devices': {'lr': 0.1, 'count': 3}}
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

from ort_lightning.errors import ConfigurationError

__all__ = ["FLAT_KEYS", "build_section", "merge_override", "parse_override", "refuse_flat_keys"]

#: The flat config's keys (before sections) and where each one lives now.
FLAT_KEYS = {
    "out": "output.folder", "resume": "output.resume", "hidden": "model.hidden", "split": "data.partition",
    "epochs": "devices.epochs", "lr": "devices.lr", "batch_size": "devices.batch_size",
    "optimizer_state": "devices.optimizer_state", "start": "devices.start", "runner": "devices.runner",
    "cpus_per_device": "devices.cpus", "device_timeout": "devices.timeout", "min_nodes": "devices.min_nodes",
    "strategy_options": "strategy.options", "host": "engine.host", "port": "engine.port", "ort_web": "engine.ort_web",
    "page_data": "engine.page_data", "max_examples": "engine.max_examples", "min_devices": "engine.min_devices",
    "wait_timeout": "engine.wait_timeout", "certfile": "engine.certfile", "keyfile": "engine.keyfile",
    "token": "engine.token",
}
#: Flat keys whose name is a section now: a scalar there is the flat form.
_SECTION_SCALARS = {"devices": "devices.count", "strategy": "strategy.name", "engine": "engine.name"}


def parse_override(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as the (dotted) key and the value YAML reads from VALUE.

    Raises:
        ConfigurationError: without ``=`` or a key before it, or for a VALUE that is not YAML.
    """
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigurationError(
            f"Expected --set KEY=VALUE, but got {text!r}; write e.g. --set devices.count=3 (one key per --set)."
        )
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as error:
        reason = " ".join(str(error).split())
        raise ConfigurationError(
            f"The value of --set {text!r} is not a YAML value ({reason}); quote a string or fix its brackets."
        ) from error


def merge_override(values: Mapping[str, Any], text: str) -> dict[str, Any]:
    """`values` with ``a.b.c=VALUE`` set at that path (the sections on the way copied, not changed)."""
    key, value = parse_override(text)
    *path, last = key.split(".")
    merged = dict(values)
    here = merged
    for part in path:
        inner = here.get(part)
        here[part] = dict(inner) if isinstance(inner, Mapping) else {}
        here = here[part]
    here[last] = value
    return merged


def refuse_flat_keys(values: Mapping[str, Any], *, where: str) -> None:
    """Refuse a key of the flat config (before sections) in one line naming its new key.

    Raises:
        ConfigurationError: for the first flat key, in sorted order.
    """
    for key in sorted(values):
        new = FLAT_KEYS.get(key) or (_SECTION_SCALARS.get(key) if not isinstance(values[key], Mapping) else None)
        if new:
            section, name = new.split(".", 1)
            value = "ray" if (key, values[key]) == ("engine", "simulation") else values[key]
            raise ConfigurationError(
                f"`{key}` in {where} is a key of the flat fleet config, which has sections now; write `{new}` "
                f"({section}: {{{name}: {value!r}}}); docs/fleets.md maps every flat key to its section."
            )


def build_section(config: type, values: Mapping[str, Any], *, where: str, prefix: str = "") -> Any:
    """The dataclass `config` from `values`, its sections built the same way, every key and type checked.

    Raises:
        ConfigurationError: for an unknown key (with the closest one and the choices), a section that is no
            mapping, or a value of the wrong type; the key is named with its section (``strategy.optons``).
    """
    known = sorted(field.name for field in dataclasses.fields(config))
    for key in sorted(set(values) - set(known)):
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"did you mean `{prefix}{close[0]}`? Valid keys: " if close else "valid keys: "
        raise ConfigurationError(f"Unknown key `{prefix}{key}` in {where}; {hint}{known}.")
    hints = typing.get_type_hints(config)
    built: dict[str, Any] = {}
    for key, value in values.items():
        hint, name = hints[key], f"{prefix}{key}"
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                inner = sorted(field.name for field in dataclasses.fields(hint))
                raise ConfigurationError(f"Expected `{name}` to be a section (a mapping of {inner}), but got "
                                         f"{value!r}; fix that key in {where}.")
            built[key] = build_section(hint, value, where=where, prefix=f"{name}.")
            continue
        expected = _accepted(hint)
        if not _matches(value, expected):
            names = " or ".join("null" if kind is type(None) else kind.__name__ for kind in expected)
            raise ConfigurationError(
                f"Expected `{name}` to be {names}, but got {value!r} ({type(value).__name__}); fix that key in {where}."
            )
        built[key] = float(value) if float in expected and isinstance(value, int) and int not in expected else value
    return config(**built)


def _accepted(hint: Any) -> tuple[type, ...]:
    """The plain classes a type hint allows (``dict[str, Any]`` -> dict; ``str | None`` -> str, NoneType)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(kind for part in typing.get_args(hint) for kind in _accepted(part))
    origin = typing.get_origin(hint)
    return (origin if origin is not None else hint,)


def _matches(value: Any, expected: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # NOTE: YAML's `yes`/`true` is a bool, which Python also counts as an int
        return bool in expected
    if isinstance(value, int) and float in expected:
        return True
    return isinstance(value, expected)
