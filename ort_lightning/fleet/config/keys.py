"""The keys of a fleet config: unknown ones named with a "did you mean", values checked against each key's type.

Pure functions over a dataclass's fields, for `FleetConfig` (the YAML file, ``--set KEY=VALUE``
on the command line, Flower's run config): `check_keys` refuses a key the dataclass does not
have and suggests the closest one (``difflib``), `check_types` refuses a value of the wrong
type before any device starts, and `parse_override` reads ``KEY=VALUE`` with YAML's scalars
(``3`` is an int, ``0.05`` a float, ``null`` None, ``{eta: 0.1}`` a mapping).

Example::

    >>> from dataclasses import dataclass
    >>> @dataclass
    ... class Config:
    ...     rounds: int = 5
    ...     lr: float = 0.01
    >>> parse_override("rounds=3")
    ('rounds', 3)
    >>> check_keys({"round": 3}, Config, where="the fleet config")
    Traceback (most recent call last):
    ...
    ort_lightning.errors.ConfigurationError: Unknown key `round` in the fleet config; did you mean `rounds`? ...
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

from ort_lightning.errors import ConfigurationError

__all__ = ["check_keys", "check_types", "parse_override"]


def parse_override(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as the key and the value YAML reads from VALUE.

    Raises:
        ConfigurationError: without ``=`` or a key before it, or for a VALUE that is not YAML.
    """
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigurationError(
            f"Expected --set KEY=VALUE, but got {text!r}; write e.g. --set rounds=3 (one key per --set)."
        )
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as error:
        reason = " ".join(str(error).split())
        raise ConfigurationError(
            f"The value of --set {text!r} is not a YAML value ({reason}); quote a string or fix its brackets."
        ) from error


def check_keys(values: Mapping[str, Any], config: type, *, where: str) -> None:
    """Refuse keys that are not fields of the dataclass `config`, naming the closest field.

    Raises:
        ConfigurationError: for the first unknown key (in sorted order), with "did you mean" when one is close.
    """
    known = sorted(field.name for field in dataclasses.fields(config))
    for key in sorted(set(values) - set(known)):
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"did you mean `{close[0]}`? Valid keys: " if close else "valid keys: "
        raise ConfigurationError(f"Unknown key `{key}` in {where}; {hint}{known}.")


def check_types(values: Mapping[str, Any], config: type, *, where: str) -> None:
    """Refuse values whose type is not the field's (an int where a float is asked is fine, a bool is no int).

    Raises:
        ConfigurationError: naming the key, the expected type and the value.
    """
    hints = typing.get_type_hints(config)
    for key, value in values.items():
        expected = _accepted(hints[key])
        if not _matches(value, expected):
            names = " or ".join("null" if kind is type(None) else kind.__name__ for kind in expected)
            raise ConfigurationError(
                f"Expected `{key}` to be {names}, but got {value!r} ({type(value).__name__}); fix that key in {where}."
            )


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
