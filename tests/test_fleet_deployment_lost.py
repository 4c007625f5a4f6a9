"""A SuperNode lost after round one of docs/fleets.md's deployment steps: round two goes on with the rest.

Its own file so that it runs beside tests/test_fleet_deployment.py on another pytest-xdist worker
(``--dist loadfile``): it mostly waits for the lost node's device timeout.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from contextlib import ExitStack, suppress
from pathlib import Path

import pytest

from ort_lightning.storage.atomic import verify_digest
from tests.helpers import RunIf

pytestmark = [pytest.mark.slow, pytest.mark.spread]

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from tests.test_fleet_deployment import (  # noqa: E402
    LOST_NODE_TIMEOUT,
    ROOT,
    SERVER,
    _descendants,
    _free_port,
    _readme_steps,
    _replace,
    _started,
    _wait_for_port,
)


@RunIf(linux=True)  # ends the processes it starts through /proc
def test_a_supernode_lost_after_round_one_leaves_round_two_to_the_rest(tmp_path: Path) -> None:
    """The page's steps with 2 rounds; SuperNode 1 gets SIGKILL once round 1's checkpoint is written."""
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

    superlink = _replace(_replace(commands["flower-superlink"], "--host 0.0.0.0", "--host 127.0.0.1"),
                         "--port 9092", f"--port {port}")
    supernode = _replace(commands["flower-supernode"], SERVER, here)
    # NOTE: a killed SuperNode stays listed until its heartbeats are missed (about a minute): round 2 may
    # still send it a message, which the device timeout then gives up on. The timeout leaves room for a
    # ClientApp process to start and fit on a busy 2-core machine (20 s was too short there).
    run = _replace(_replace(commands["flwr"], "/srv/fleet", str(folder)), "rounds=5",
                   f"rounds=2 device_timeout={LOST_NODE_TIMEOUT}")
    first = folder / "run" / "rounds" / "round-0001.ortckpt"
    with ExitStack() as stack:
        link = stack.enter_context(_started(shlex.split(superlink), tmp_path / "superlink.log", env))
        _wait_for_port(port, link, tmp_path / "superlink.log")
        nodes = []
        for partition in (0, 1):
            node = _replace(supernode, "partition-id=0", f"partition-id={partition}")
            nodes.append(stack.enter_context(_started([*shlex.split(node), "--port", str(_free_port())],
                                                      tmp_path / f"supernode-{partition}.log", env)))
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
    assert flwr.returncode == 0, logs
    history = json.loads((folder / "run" / "history.json").read_text(encoding="utf-8"))
    assert [(r["round"], r["devices"]) for r in history["rounds"]] == [(1, 2), (2, 1)], logs
    assert verify_digest(folder / "run" / "rounds" / "round-0002.ortckpt")
    # round 2 waited at most the device timeout for the lost node, not for ever (plus evaluation and exit)
    assert finished - killed < LOST_NODE_TIMEOUT + 60, logs
    shown = (tmp_path / "flwr.log").read_text()
    assert re.search(r"^round  2: accuracy \d+\.\d+%.*\(.*; 1 devices", shown, re.MULTILINE), logs
    failures = history["rounds"][1]["failures"]
    # the lost node, if the SuperLink still listed it: unanswered, or reported lost by the SuperLink
    assert len(failures) <= 1, failures
    lost = rf"no reply within the device timeout of {LOST_NODE_TIMEOUT} s|Node Unavailable"
    assert all(re.search(lost, reason) for reason in failures.values()), failures
