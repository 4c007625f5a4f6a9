"""The multi-machine steps of docs/fleets.md (Flower's deployment runtime) run as written, on one machine.

A SuperLink and two SuperNodes run as processes on free localhost ports, and ``flwr run`` submits
the app project ``examples/fleet_app``. Of the page's commands the test changes only the
addresses (the server machine's becomes 127.0.0.1 and a free port; each SuperNode gets a local
``--port`` of its own, as the page says for one machine), the ``/srv/fleet`` folder (a temporary
one) and the rounds (2 instead of 5, with a device timeout). One deployment checks both the page's
steps (round 1 on both SuperNodes) and a SuperNode lost after round 1 (round 2 on the other one); before
them, one round through Flower's SecAgg+ (``secagg.enabled=true``) on the same SuperLink and SuperNodes.
Every process it starts is ended in ``finally``.
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
from tests.helpers import ROOT, RunIf

pytestmark = [pytest.mark.slow, pytest.mark.spread]

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

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


def _prepared(tmp_path: Path) -> tuple[dict[str, str], int, Path, dict[str, str]]:
    """The README's steps before the SuperLink starts: Flower's config at a free port, the export into ``srv``.

    Returns the page's commands, the SuperLink's port, the export's folder and the processes' environment.
    """
    commands, toml = _readme_steps()
    port = _free_port()
    folder = tmp_path / "srv"
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_HOME": str(tmp_path / "flwr-home"), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}
    (tmp_path / "flwr-home").mkdir()
    (tmp_path / "flwr-home" / "config.toml").write_text(_replace(toml, SERVER, f"127.0.0.1:{port}") + "\n",
                                                        encoding="utf-8")
    export = shlex.split(_replace(commands["ort-lightning"], "/srv/fleet", str(folder)))
    subprocess.run(export, env=env, check=True, capture_output=True, timeout=300)
    assert (folder / "artifacts" / "nominal_checkpoint").is_file()  # what the SuperNodes start from
    return commands, port, folder, env


@RunIf(linux=True)  # ends the processes it starts through /proc
def test_readme_deployment_steps_run_a_round_on_two_supernodes_and_one_without_a_lost_node(tmp_path: Path) -> None:
    """The page's steps with 2 rounds; SuperNode 1 gets SIGKILL once round 1's checkpoint is written.

    Before them, the same SuperLink and SuperNodes run the page's ``flwr run`` with ``secagg.enabled=true`` for
    one round (into a folder of its own): Flower's SecAgg+ over the deployment runtime.
    """
    commands, port, folder, env = _prepared(tmp_path)
    superlink = _replace(_replace(commands["flower-superlink"], "--host 0.0.0.0", "--host 127.0.0.1"),
                         "--port 9092", f"--port {port}")
    supernode = _replace(commands["flower-supernode"], SERVER, f"127.0.0.1:{port}")
    # NOTE: a killed SuperNode stays listed until its heartbeats are missed (about a minute): round 2 may
    # still send it a message, which the device timeout then gives up on. The timeout leaves room for a
    # ClientApp process to start and fit on a busy 2-core machine (20 s was too short there).
    run = _replace(_replace(commands["flwr"], "/srv/fleet", str(folder)), "rounds=5",
                   f"rounds=2 devices.timeout={LOST_NODE_TIMEOUT}")
    secure = _replace(_replace(_replace(commands["flwr"], "/srv/fleet/run", str(folder / "secure")), "/srv/fleet",
                                        str(folder)), "rounds=5", "rounds=1 secagg.enabled=true devices.min_nodes=2")
    first = folder / "run" / "rounds" / "round-0001.ortckpt"
    with ExitStack() as stack:
        link = stack.enter_context(_started(shlex.split(superlink), tmp_path / "superlink.log", env))
        _wait_for_port(port, link, tmp_path / "superlink.log")
        nodes = []
        for partition in (0, 1):
            node = _replace(supernode, "partition-id=0", f"partition-id={partition}")
            nodes.append(stack.enter_context(_started([*shlex.split(node), "--port", str(_free_port())],
                                                      tmp_path / f"supernode-{partition}.log", env)))
        stack.enter_context(_started(shlex.split(secure), tmp_path / "flwr-secure.log", env, cwd=ROOT)).wait(300)
        flwr = stack.enter_context(_started(shlex.split(run), tmp_path / "flwr.log", env, cwd=ROOT))
        deadline = time.monotonic() + 300
        while not first.exists() and flwr.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in (nodes[1].pid, *_descendants(nodes[1].pid)):  # as a lost machine: no goodbye to the SuperLink
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        flwr.wait(timeout=max(1.0, deadline - time.monotonic()))
        finished = time.monotonic()

    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log")))
    _assert_secure_round(folder / "secure", tmp_path / "flwr-secure.log", logs)
    assert flwr.returncode == 0, logs
    history = json.loads((folder / "run" / "history.json").read_text(encoding="utf-8"))
    assert [(r["round"], r["devices"]) for r in history["rounds"]] == [(1, 2), (2, 1)], logs
    # round 1, the page's steps as written: both SuperNodes trained, the round is written and learned
    assert verify_digest(first)
    assert history["rounds"][0]["accuracy"] > history["initial"]["accuracy"] + 0.3, history
    shown = (tmp_path / "flwr.log").read_text()
    assert re.search(r"^round  1: accuracy \d+\.\d+%", shown, re.MULTILINE), logs
    # round 2, without the lost SuperNode
    assert verify_digest(folder / "run" / "rounds" / "round-0002.ortckpt")
    # round 2 waited at most the device timeout for the lost node, not for ever (plus evaluation and exit)
    assert finished - killed < LOST_NODE_TIMEOUT + 60, logs
    assert re.search(r"^round  2: accuracy \d+\.\d+%.*\(.*; 1 devices", shown, re.MULTILINE), logs
    failures = history["rounds"][1]["failures"]
    # the lost node, if the SuperLink still listed it: unanswered, or reported lost by the SuperLink
    assert len(failures) <= 1, failures
    lost = rf"no reply within the device timeout of {LOST_NODE_TIMEOUT} s|Node Unavailable"
    assert all(re.search(lost, reason) for reason in failures.values()), failures


def test_run_config_without_artifacts_is_named() -> None:
    from ort_lightning.fleet.engines.deployment import read_run_config

    with pytest.raises(ValueError, match=r"The run config has no `model.artifacts` key; add artifacts = "):
        read_run_config({"devices.count": 2, "rounds": 1})


def _assert_secure_round(run: Path, log: Path, logs: str) -> None:
    """The secure run's one round: both SuperNodes' masked updates summed, written and learned."""
    history = json.loads((run / "history.json").read_text(encoding="utf-8"))
    (record,) = history["rounds"]
    assert (record["devices"], record["halted"], record["failures"]) == (2, None, {}), logs
    assert verify_digest(run / "rounds" / "round-0001.ortckpt")
    assert record["accuracy"] > history["initial"]["accuracy"] + 0.3, history
    assert re.search(r"^2 devices, iid split, fedavg, SecAgg\+", log.read_text(), re.MULTILINE), logs
