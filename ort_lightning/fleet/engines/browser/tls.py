"""TLS for a browser fleet: the certificate files it serves HTTPS and WSS with, and which hosts need none.

Example::

    >>> tls_files(None, None) is None
    True
    >>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("0.0.0.0")
    (True, True, False)
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from ort_lightning.errors import ConfigurationError

__all__ = ["is_loopback", "tls_files"]


def tls_files(
    certfile: str | os.PathLike[str] | None, keyfile: str | os.PathLike[str] | None
) -> tuple[str, str] | None:
    """The certificate and key paths, once both are given and exist; None for neither.

    Raises:
        ConfigurationError: for one without the other, or a file that does not exist.
    """
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        given, missing = ("certfile", "keyfile") if keyfile is None else ("keyfile", "certfile")
        raise ConfigurationError(f"Expected both certfile and keyfile for TLS, but got {given} without {missing}; "
                                 "pass the PEM certificate and its private key, or neither (plain HTTP).")
    paths = (Path(certfile).expanduser(), Path(keyfile).expanduser())
    for key, path in zip(("certfile", "keyfile"), paths, strict=True):
        if not path.is_file():
            raise ConfigurationError(f"Expected `{key}` to be a PEM file, but {os.fspath(path)!r} does not exist; "
                                     "pass the path of your certificate and its key (docs/browsers.md shows how to "
                                     "make a local one).")
    return str(paths[0].resolve()), str(paths[1].resolve())


def is_loopback(host: str) -> bool:
    """Whether `host` only listens on this machine (then the token and updates never cross a network)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
