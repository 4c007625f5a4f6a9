"""What a browser or Node needs to train the device artifacts: the runner, its wire, and onnxruntime-web.

`asset` is the path of a shipped file (``runner.js``, ``wire.js``, ``wire.json``), `wire` what a web device
and the fleet's server agree on, `find_ort_web` where npm's onnxruntime-web is. Nothing here imports ONNX
Runtime or torch.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, cast

from ort_lightning.errors import ConfigurationError

__all__ = ["ENVIRONMENT_VARIABLE", "ORT_WEB_VERSION", "TRAINING_BUILD", "asset", "find_ort_web", "wire"]

#: The onnxruntime-web release the runner is written and tested against (its last one with training).
ORT_WEB_VERSION = "1.19.2"
#: The training build of onnxruntime-web, an ES module inside its ``dist/`` folder.
TRAINING_BUILD = "ort.training.wasm.min.mjs"
#: Where `find_ort_web` looks first after its argument: a ``dist/`` folder or a URL.
ENVIRONMENT_VARIABLE = "ORT_LIGHTNING_ORT_WEB"

_HERE = Path(__file__).resolve().parent
_ASSET_SUFFIXES = (".js", ".json")
_INSTALL = f"npm install onnxruntime-web@{ORT_WEB_VERSION}"


def asset(name: str) -> Path:
    """Return the path of a web file this subpackage ships, e.g. ``"runner.js"``.

    Raises:
        ConfigurationError: The package ships no file of that name.
    """
    shipped = sorted(path.name for path in _HERE.iterdir() if path.suffix in _ASSET_SUFFIXES)
    if name not in shipped:
        raise ConfigurationError(
            f"Expected the name of a web file ort_lightning ships, one of {shipped}, but got {name!r}; "
            "pass one of those names"
        )
    return _HERE / name


@functools.cache
def wire() -> dict[str, Any]:
    """``wire.json``, which ``wire.js`` imports: each side's message types and the WebSocket close codes by name."""
    return cast(dict[str, Any], json.loads((_HERE / "wire.json").read_text(encoding="utf-8")))


def find_ort_web(dist: str | None = None) -> str:
    """Return onnxruntime-web's ``dist/`` folder (absolute), or the URL that serves it (as given, unfetched).

    Looked for in `dist`, then ``ORT_LIGHTNING_ORT_WEB``, then ``node_modules/onnxruntime-web/dist``
    here or above. A folder must hold the training build; a URL is returned as given, not fetched.

    Raises:
        ConfigurationError: The folder given lacks the training build, or none is found.
    """
    if dist is not None:
        return _checked(dist, "dist=")
    configured = os.environ.get(ENVIRONMENT_VARIABLE)
    if configured:
        return _checked(configured, f"{ENVIRONMENT_VARIABLE}=")
    here = Path.cwd()
    for folder in (here, *here.parents):
        candidate = folder / "node_modules" / "onnxruntime-web" / "dist"
        if candidate.is_dir():
            return _checked(str(candidate), f"npm's folder {folder}")
    raise ConfigurationError(
        f"Expected onnxruntime-web {ORT_WEB_VERSION} for the device runner, but {ENVIRONMENT_VARIABLE} is not set "
        f"and there is no node_modules/onnxruntime-web/dist in {here} or its parents; run {_INSTALL} "
        f"in this folder (or a parent), or pass its dist/ folder or a URL that serves it "
        f"(find_ort_web(dist=...) or {ENVIRONMENT_VARIABLE}=...)"
    )


def _checked(dist: str, source: str) -> str:
    """`dist` as `find_ort_web` returns it, once a folder is known to hold the training build."""
    if dist.startswith(("http://", "https://")):
        return dist.rstrip("/")
    folder = Path(dist).expanduser().resolve()
    if not (folder / TRAINING_BUILD).is_file():
        raise ConfigurationError(
            f"Expected onnxruntime-web's dist/ folder with its training build {TRAINING_BUILD}, but {folder} "
            f"(from {source}) has no such file; run {_INSTALL} and pass node_modules/onnxruntime-web/dist, "
            "or a URL that serves that folder"
        )
    return str(folder)
