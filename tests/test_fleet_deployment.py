"""The multi-machine steps of docs/fleets.md (Flower's deployment runtime) run as written, on one machine.

A SuperLink and two SuperNodes run as processes on free localhost ports, and ``flwr run`` submits
the app project ``examples/fleet_app``. Of the page's commands the test changes only the
addresses (the server machine's becomes 127.0.0.1 and a free port; each SuperNode gets a local
``--port`` of its own, as the page says for one machine), the ``/srv/fleet`` folder (a temporary
one) and the rounds (1 instead of 5). Every process it starts is ended in ``finally``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import pytest

from ort_lightning.storage.atomic import verify_digest
from tests.helpers import RunIf

pytestmark = [pytest.mark.slow, pytest.mark.spread]

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "fleets.md"
SECTION = "## From the simulation to Flower's deployment runtime"
BLOCK = re.compile(r"^( *)```(bash|toml)\n(.*?)^\1```$", re.S | re.M)
SERVER = "10.0.0.1:9092"
LOST_NODE_TIMEOUT = 90


def _readme_steps() -> tuple[dict[str, str], str]:
    """The page's commands, by program, and its Flower configuration block."""
    text = PAGE.read_text(encoding="utf-8").split(SECTION, 1)[1].split("\n## ", 1)[0]
    commands: dict[str, str] = {}
    toml = ""
    for _, kind, body in BLOCK.findall(text):
        body = textwrap.dedent(body).strip()
        if kind == "toml":
            toml = body
            continue
        for line in body.splitlines():
            commands[line.split()[0]] = line
    assert set(commands) == {"ort-lightning", "flower-superlink", "flower-supernode", "flwr"}, commands
    assert toml, "docs/fleets.md gives no Flower configuration block"
    return commands, toml


def _replace(text: str, old: str, new: str) -> str:
    assert old in text, f"docs/fleets.md's step no longer says {old!r}: {text}"
    return text.replace(old, new)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for_port(port: int, process: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the SuperLink exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    pytest.fail(f"the SuperLink did not listen on {port} within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Flower's SuperExec starts the apps in sessions of their own)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _end(process: subprocess.Popen[bytes]) -> None:
    """End `process` and everything it started, by process id: TERM, then KILL whatever is left."""
    pids = [process.pid, *_descendants(process.pid)]
    for number in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, number)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        if all(not Path(f"/proc/{pid}").exists() for pid in pids[1:]):
            return


@contextmanager
def _started(
    command: list[str], log: Path, env: dict[str, str], cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as stream:
        process = subprocess.Popen(command, stdout=stream, stderr=subprocess.STDOUT, env=env, cwd=cwd or log.parent,
                                   start_new_session=True)
    try:
        yield process
    finally:
        _end(process)


@RunIf(linux=True)  # ends the processes it starts through /proc
def test_readme_deployment_steps_run_one_round_on_a_superlink_and_two_supernodes(tmp_path: Path) -> None:
    commands, toml = _readme_steps()
    port = _free_port()
    here = f"127.0.0.1:{port}"
    folder = tmp_path / "srv"
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_HOME": str(tmp_path / "flwr-home"), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    (tmp_path / "flwr-home").mkdir()
    (tmp_path / "flwr-home" / "config.toml").write_text(_replace(toml, SERVER, here) + "\n", encoding="utf-8")

    export = shlex.split(_replace(commands["ort-lightning"], "/srv/fleet", str(folder)))
    subprocess.run(export, env=env, check=True, capture_output=True, timeout=300)
    assert (folder / "artifacts" / "nominal_checkpoint").is_file()  # what the SuperNodes start from

    superlink = _replace(_replace(commands["flower-superlink"], "--host 0.0.0.0", "--host 127.0.0.1"),
                         "--port 9092", f"--port {port}")
    supernode = _replace(commands["flower-supernode"], SERVER, here)
    run = _replace(_replace(commands["flwr"], "/srv/fleet", str(folder)), "rounds=5", "rounds=1")
    with ExitStack() as stack:
        link = stack.enter_context(_started(shlex.split(superlink), tmp_path / "superlink.log", env))
        _wait_for_port(port, link, tmp_path / "superlink.log")
        for partition in (0, 1):
            node = _replace(supernode, "partition-id=0", f"partition-id={partition}")
            stack.enter_context(_started([*shlex.split(node), "--port", str(_free_port())],
                                         tmp_path / f"supernode-{partition}.log", env))
        result = subprocess.run(shlex.split(run), env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
                                check=False)

    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log")))
    shown = result.stdout + result.stderr
    assert result.returncode == 0, f"{shown[-3000:]}\n{logs}"
    assert re.search(r"^round  1: accuracy \d+\.\d+%", shown, re.MULTILINE), f"{shown[-3000:]}\n{logs}"
    assert verify_digest(folder / "run" / "rounds" / "round-0001.ortckpt")
    history = json.loads((folder / "run" / "history.json").read_text(encoding="utf-8"))
    assert [(r["round"], r["devices"]) for r in history["rounds"]] == [(1, 2)]
    assert history["rounds"][0]["accuracy"] > history["initial"]["accuracy"] + 0.3


def test_run_config_without_artifacts_is_named() -> None:
    from ort_lightning.fleet.deploy import read_run_config

    with pytest.raises(ValueError, match=r"The run config has no `artifacts` key; add artifacts = "):
        read_run_config({"devices": 2, "rounds": 1})
