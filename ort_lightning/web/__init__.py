"""What a browser or Node needs to train the device artifacts: the runner and onnxruntime-web.

The package ships the device runner (``runner.js``, an ES module without dependencies; the browser
fleet's page and its device scripts ship with `ort_lightning.fleet.engines.browser`); onnxruntime-web itself
comes from npm (``npm install onnxruntime-web@1.19.2``) and is never copied into the package.
`asset` is the path of a shipped file, `find_ort_web` where onnxruntime-web's ``dist/`` folder is
(or the URL that serves it).

Nothing here imports ONNX Runtime or torch: the subpackage sits just above ``errors``.
"""

from __future__ import annotations

import os
from pathlib import Path

from ort_lightning.errors import ConfigurationError

__all__ = ["ENVIRONMENT_VARIABLE", "ORT_WEB_VERSION", "TRAINING_BUILD", "asset", "find_ort_web"]

#: The onnxruntime-web release the runner is written and tested against (its last one with training).
ORT_WEB_VERSION = "1.19.2"
#: The training build of onnxruntime-web, an ES module inside its ``dist/`` folder.
TRAINING_BUILD = "ort.training.wasm.min.mjs"
#: Where `find_ort_web` looks first after its argument: a ``dist/`` folder or a URL.
ENVIRONMENT_VARIABLE = "ORT_LIGHTNING_ORT_WEB"

_HERE = Path(__file__).resolve().parent
_ASSET_SUFFIXES = (".js",)
_INSTALL = f"npm install onnxruntime-web@{ORT_WEB_VERSION}"


def asset(name: str) -> Path:
    """Return the path of a web file this subpackage ships (``runner.js``, the device runner).

    Args:
        name: The file's name, e.g. ``"runner.js"``.

    Returns:
        The file's path inside the installed package.

    Raises:
        ConfigurationError: The package ships no file of that name.

    Example::

        >>> from ort_lightning.web import asset
        >>> path = asset("runner.js")
        >>> path.name, path.is_file()
        ('runner.js', True)
    """
    shipped = sorted(path.name for path in _HERE.iterdir() if path.suffix in _ASSET_SUFFIXES)
    if name not in shipped:
        raise ConfigurationError(
            f"Expected the name of a web file ort_lightning ships, one of {shipped}, but got {name!r}; "
            "pass one of those names"
        )
    return _HERE / name


def find_ort_web(dist: str | None = None) -> str:
    """Return onnxruntime-web's ``dist/`` folder (or the URL that serves it) for the device runner.

    Looked for in this order: `dist`, the environment variable ``ORT_LIGHTNING_ORT_WEB``, then
    ``node_modules/onnxruntime-web/dist`` in the current folder or one of its parents (where
    ``npm install onnxruntime-web@1.19.2`` puts it). A folder must hold the training build
    (``ort.training.wasm.min.mjs``); a URL (``http://`` or ``https://``) is returned as given,
    without its trailing slash, and not fetched.

    Args:
        dist: A ``dist/`` folder or URL; None looks in the environment and the folders above.

    Returns:
        The folder's absolute path, or the URL.

    Raises:
        ConfigurationError: The folder given lacks the training build, or none is found.

    Example::

        >>> from ort_lightning.web import find_ort_web
        >>> find_ort_web("https://cdn.jsdelivr.net/npm/onnxruntime-web@1.19.2/dist/")
        'https://cdn.jsdelivr.net/npm/onnxruntime-web@1.19.2/dist'
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
