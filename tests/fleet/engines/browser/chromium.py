"""Headless Chromium pages as fleet devices: one process per page, each with a fresh profile."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from tests._web import chromium_program

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


@contextmanager
def chromium(urls: dict[str, str], *, profile: Path | None = None) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """One headless Chromium per URL (each with a fresh profile, or the one `profile` folder, kept), killed on exit."""
    program = chromium_program()
    assert program is not None
    processes: dict[str, subprocess.Popen[bytes]] = {}
    profiles = [str(profile) if profile else tempfile.mkdtemp(prefix="ort-lightning-chromium-") for _ in urls]
    try:
        for (name, url), profile in zip(urls.items(), profiles, strict=True):
            processes[name] = subprocess.Popen([program, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", url],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                               start_new_session=True)
        yield processes
    finally:
        for process in processes.values():
            kill_browser(process)
        for folder in profiles:
            if profile is None:
                shutil.rmtree(folder, ignore_errors=True)


def kill_browser(process: subprocess.Popen[bytes]) -> None:
    """Close a browser as a crash or a closed laptop does: its process group (renderers included) at once."""
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
