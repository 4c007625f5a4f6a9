r"""One-line usage errors for the console script, with the closest valid choice for a misspelling.

argparse and jsonargparse print the whole usage text, then a multi-line error; the console
script prints one line instead, naming the bad key or value and what is valid.

Example::

    >>> closest("max_epoch", ["max_epochs", "min_epochs", "max_steps"])
    'max_epochs'
    >>> one_line_argument_error('Parser key "model.lr":\n  Expected a <class \'float\'>. Got value: x', [])
    "bad value 'x' for model.lr: expected a float"
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterable
from typing import Any, NoReturn

from ort_lightning.errors import ConfigurationError

__all__ = ["OneLineParser", "UsageError", "closest", "one_line_argument_error"]


class UsageError(ConfigurationError):
    """A mistake on the command line or in a config file: printed as one line, exit status 2."""


def closest(word: str, choices: Iterable[str]) -> str | None:
    """Return the valid choice nearest to a misspelled `word`, or None when nothing is near."""
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ``"; did you mean 'x'?"`` for the nearest choice, or an empty string."""
    match = closest(word, choices)
    return f"; did you mean {match!r}?" if match else ""


class OneLineParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose errors raise `UsageError` (one line) instead of printing the usage.

    Options are never abbreviated: a misspelt ``--frozn`` is an error with "did you mean", not a guess.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Raise `UsageError` with argparse's message and the closest valid choice."""
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            valid = re.findall(r"'([^']*)'", choice.group(2))
            raise UsageError(f"{message}{did_you_mean(choice.group(1), valid)}")
        unknown = re.search(r"unrecognized arguments: (\S+)", message)
        if unknown:
            raise UsageError(f"{self.prog}: {message}{did_you_mean(unknown.group(1), self._option_strings())}")
        raise UsageError(f"{self.prog}: {message}; see {self.prog} --help")

    def _option_strings(self) -> list[str]:
        options = [option for action in self._actions for option in action.option_strings]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for parser in action.choices.values():
                    options += [option for sub in parser._actions for option in sub.option_strings]
        return options


# ----------------------------------------------------------------------------- jsonargparse
_NOT_ACCEPTED = re.compile(r"does not accept option '([^']+)'|unrecognized arguments: --?(\S+)")
_BAD_VALUE = re.compile(r'Parser key "([^"]+)"')
_MISSING_FILE = re.compile(r"(?:File does not exist|Unable to access path)[:\s]*'?([^'\n]+)'?")
_LITERAL = re.compile(r"Literal\[([^\]]*)\]")
_TYPE = re.compile(r"Expected an? <class '(\w+)'>")


def one_line_argument_error(message: str, keys: Iterable[str]) -> str:
    """Rewrite a (multi-line) jsonargparse error as one line that names the key or value and what is valid.

    Args:
        message: the text of jsonargparse's ``ArgumentError``.
        keys: every key the subcommand accepts (``trainer.max_epochs``, ``model.lr``, ...).
    """
    unknown = _NOT_ACCEPTED.search(message)
    if unknown:
        return _unknown_key(unknown.group(1) or unknown.group(2), list(keys))
    missing = _MISSING_FILE.search(message)
    if missing and '"config"' in message:
        return (f"config file {missing.group(1).strip()!r} does not exist; pass --config with the path of a YAML file, "
                "e.g. --config examples/digits.yaml")
    bad = _BAD_VALUE.search(message)
    if bad:
        return _bad_value(bad.group(1), message)
    if "arguments are required" in message:
        return (f"{' '.join(message.split())}; pass --config cfg.yaml (e.g. examples/digits.yaml), "
                "or each of them as --key value")
    return " ".join(message.split())


def _unknown_key(key: str, keys: list[str]) -> str:
    key = key.split("=")[0].lstrip("-")
    section, _, leaf = key.rpartition(".")
    siblings = sorted(k for k in keys if k.rpartition(".")[0] == section)
    # NOTE: within a section compare the last part only: the shared "model." prefix makes any two keys look alike.
    by_leaf = {k.rpartition(".")[2]: k for k in siblings}
    match = by_leaf.get(closest(leaf, by_leaf) or "") if siblings else closest(key, keys)
    hint = f"; did you mean {match!r}?" if match else "."
    if siblings and len(siblings) <= 20:
        return f"unknown key {key!r}{hint} Valid keys under {section or 'the top level'!r}: {', '.join(siblings)}"
    return f"unknown key {key!r}{hint} Run with --help for every valid key"


def _bad_value(key: str, message: str) -> str:
    given = re.search(r"(?:Given value|Got value):\s*(.*)", message)
    value = given.group(1).strip() if given else "?"
    problem = re.search(r"Problem with given class_path '([^']+)':\s*(.*)", message)
    if problem:
        return (f"bad value {problem.group(1)!r} for {key}: {problem.group(2).strip()}; name an importable class, "
                "e.g. ort_lightning.demo.DigitsDataModule")
    choices = [choice.strip(" '\"") for literal in _LITERAL.findall(message) for choice in literal.split(",")]
    choices = list(dict.fromkeys(choices))  # jsonargparse repeats the literals once per union member
    if choices:
        return f"bad value {value!r} for {key}{did_you_mean(value, choices) or '.'} Valid values: {', '.join(choices)}"
    types = sorted(set(_TYPE.findall(message)) - {"NoneType"})
    if types:
        return f"bad value {value!r} for {key}: expected a {' or '.join(types)}"
    detail = " ".join(message.split()[3:])[:300]
    return f"bad value {value!r} for {key}: {detail}"
