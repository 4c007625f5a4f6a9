"""Helpers of the web tests: where onnxruntime-web, Node and Chromium are, what is missing, a Node run.

A web test skips only where its program (``node``, ``chromium``) or onnxruntime-web's ``dist/``
folder is missing, and says which; ``.ci/run`` installs all three, so that they run there.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ort_lightning.errors import ConfigurationError
from ort_lightning.web import find_ort_web

__all__ = ["CHROMIUM_MISSING", "NODE_DEVICE", "NODE_MISSING", "ROOT", "NodeError", "NodeRun", "chromium_program",
           "free_port", "node_beside", "node_devices_when_served", "ort_web_dist", "run_beside_node", "run_node"]

ROOT = Path(__file__).resolve().parents[1]
#: The page's FleetDevice and runner.js in Node: ``node_device.mjs URL --ort-web DIST --devices N``.
NODE_DEVICE = ROOT / "ort_lightning" / "fleet" / "devices" / "web" / "node_device.mjs"
#: Debian's package installs ``chromium``; other distributions name it ``chromium-browser``.
CHROMIUM_NAMES = ("chromium", "chromium-browser")


def ort_web_dist() -> str | None:
    """onnxruntime-web's ``dist/`` folder as the product finds it, else the repository's npm folder, else None."""
    for dist in (None, str(ROOT / "node_modules" / "onnxruntime-web" / "dist")):
        try:
            return find_ort_web(dist)
        except ConfigurationError:
            continue
    return None


def chromium_program() -> str | None:
    """The path of a Chromium on PATH, or None."""
    return next((path for path in map(shutil.which, CHROMIUM_NAMES) if path), None)


def _missing(program: str | None, name: str) -> str | None:
    if program is None:
        return f"{name} is not installed (.ci/run installs it)"
    if ort_web_dist() is None:
        return "onnxruntime-web is not installed: run npm install onnxruntime-web@1.19.2 at the repository root"
    return None


#: Why a Node or Chromium test cannot run here (``RunIf(node=True)``, ``RunIf(chromium=True)``), or None.
NODE_MISSING = _missing(shutil.which("node"), "node (Node.js 20)")
CHROMIUM_MISSING = _missing(chromium_program(), "Chromium")



class NodeError(RuntimeError):
    """A Node script exited with an error; the message is the error line Node printed."""


def run_node(script: Path, *args: str, timeout: float = 120) -> str:
    """Run ``node script args...`` from the repository root; its stdout, or `NodeError` with its error line.

    Node prints an uncaught ``Error`` as ``Error: message`` followed by the stack; that line, the
    runner's own message, is what the error carries (the whole stderr when there is no such line).
    """
    node = shutil.which("node")
    assert node is not None, "run_node needs the RunIf(node=True) marker"
    result = subprocess.run(
        [node, str(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
        raise NodeError(lines[0].removeprefix("Error: ") if lines else result.stderr[-3000:])
    return result.stdout


@dataclass
class NodeRun:
    """A Node process started beside a fleet; its output once it has ended."""

    process: subprocess.Popen[str]
    stdout: str = ""
    stderr: str = ""


@contextmanager
def node_beside(script: Path, *args: object) -> Iterator[NodeRun]:
    """``node --experimental-websocket script args...`` from the repository root, waited for (60 s) on the way out."""
    node = shutil.which("node")
    assert node is not None, "node_beside needs the RunIf(node=True) marker"
    process = subprocess.Popen([node, "--experimental-websocket", str(script), *map(str, args)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = NodeRun(process)
    try:
        yield run
    finally:
        run.stdout, run.stderr = process.communicate(timeout=60)


def run_beside_node(fleet: Any, server: Any, script: Path, *args: object, join_timeout: float = 90) -> NodeRun:
    """Run `server` on the browser `fleet` while a Node script plays its devices; closed before Node is waited for."""
    with node_beside(script, *args) as run:
        try:
            fleet.run(server, join_timeout=join_timeout)
        finally:
            fleet.close()
    return run


def free_port() -> int:
    """A localhost port no one listens on now (a fleet whose URL a test must know before it starts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def node_devices_when_served(port: int, token: str, count: int, outputs: list[str], *, timeout: float = 240) -> None:
    """Start `count` Node devices in one process once a fleet serves on `port`; append their exit code and output."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    done = subprocess.run([str(shutil.which("node")), "--experimental-websocket", str(NODE_DEVICE),
                           f"http://127.0.0.1:{port}/?token={token}", "--ort-web", str(ort_web_dist()), "--devices",
                           str(count)], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)
    outputs.append(f"exit {done.returncode}\n{done.stdout}{done.stderr}")
