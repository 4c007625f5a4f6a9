"""Node devices killed at each SecAgg+ stage of a secure browser fleet: the rounds go on without them.

Each device that dies is a Node process of its own (tests/web/node_quit.mjs) that SIGKILLs itself when
the server's frame for its stage and round arrives; the others share one process. One run, threshold 3:

- round 1, six devices: one dies at share keys (its public keys sent, its shares not), one at collect
  (its shares out: theirs of its key remove the masks the others made with it); four vectors count;
- round 2, four devices: one dies at unmask (its masked vector in: its mask seed is rebuilt from shares);
- round 3, three devices: one dies at collect, two remain, below the threshold: the round halts;
- round 4: a fresh device joined when that one died; the round starts from round 2's values.

The reference is ONNX Runtime's documented loop per counted device, averaged here in float64 by
example count; it must hold within docs/fleets.md's bound plus the browsers' tolerance.
"""

from __future__ import annotations

import shutil
import subprocess
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from ort_lightning import TrainingArtifacts
from tests._web import NODE_DEVICE, ROOT, node_beside, ort_web_dist
from tests.fleet.secure_bound import fedavg, secagg_bound
from tests.helpers import RunIf, ort_device_loop

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from ort_lightning.fleet import BrowserFleet, GlobalModel, RoundRecord, round_path  # noqa: E402
from ort_lightning.fleet.engines.browser.population import PopulationEvent  # noqa: E402
from ort_lightning.fleet.server.secure import SecureFleetServer  # noqa: E402
from tests.fleet.engines.browser.digits_rounds import (  # noqa: E402
    BROWSER_ATOL,
    DATA,
    LR,
    checkpoint_values,
    initial_values,
)

QUIT = ROOT / "tests" / "web" / "node_quit.mjs"
DEVICES = 6
#: Who dies where: (name, SecAgg+ stage, round).
KILLS = [("keys-1", "share_keys", 1), ("collect-1", "collect_masked_vectors", 1), ("unmask-2", "unmask", 2),
         ("collect-3", "collect_masked_vectors", 3)]
SURVIVORS = ["keep-1", "keep-2"]
#: The devices' and the stages' timeout: a round that waited for a dead device's reply would take this long.
TIMEOUT = 60.0
HALTED = ("secure aggregation stopped at its collect masked vectors stage: 2 of 3 devices still answered, below the "
          "reconstruction threshold of 3 shares; no aggregate this round, and the next one starts from the same values")


def _fits(folder: Path, start: dict[str, np.ndarray], partitions: list[int]) -> tuple[list[dict[str, np.ndarray]],
                                                                                       list[int]]:
    """Each partition's round from `start` by ORT's documented loop, and its example count."""
    loaders = [DATA(p, DEVICES).train for p in partitions]
    return ([ort_device_loop(folder, list(loader), lr=LR, graphs="ort", values=start) for loader in loaders],
            [len(loader.dataset) for loader in loaders])  # type: ignore[arg-type]


def _distance(path: Path | None, expected: dict[str, np.ndarray]) -> float:
    assert path is not None
    got = checkpoint_values(path)
    return max(float(np.max(np.abs(got[name].astype(np.float64) - value))) for name, value in expected.items())


def _assert_counted(folder: Path, record: RoundRecord, start: dict[str, np.ndarray], counted: list[int],
                    other: list[int]) -> None:
    """The round's aggregate is the FedAvg of exactly `counted`'s partitions, not of `other`'s, within the bound."""
    fits, counts = _fits(folder, start, counted)
    expected = fedavg(fits, counts)
    tolerance = secagg_bound(fits, counts, expected) + BROWSER_ATOL
    assert _distance(record.checkpoint, expected) <= tolerance
    wrong = fedavg(*_fits(folder, start, other))
    assert _distance(record.checkpoint, wrong) > 10 * tolerance  # the check tells the two sets apart


def _run(exported: TrainingArtifacts, web: TrainingArtifacts, folder: Path
         ) -> tuple[SecureFleetServer, dict[str, tuple[int, int]], dict[str, tuple[int | None, str]]]:
    """The run: its server, each device's (node id, partition), each process's exit code and stderr by name."""
    dist = str(ort_web_dist())
    fresh: list[subprocess.Popen[str]] = []

    def replace(event: PopulationEvent) -> None:
        if (event.device, event.kind) == ("collect-3", "was dropped"):  # a fresh device joins once it is gone
            fresh.append(subprocess.Popen([str(shutil.which("node")), "--experimental-websocket", str(NODE_DEVICE),
                                           fleet.url, "--ort-web", dist, "--name", "fresh"], cwd=ROOT,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True))

    server = SecureFleetServer(GlobalModel(exported), rounds=4, directory=folder, devices=DEVICES, min_nodes=3,
                               secagg={"num_shares": 5, "reconstruction_threshold": 3}, device_timeout=TIMEOUT)
    fleet = BrowserFleet(web, DATA, port=0, devices=DEVICES, device_timeout=TIMEOUT, ort_web=dist,
                         wait_timeout=20, on_event=replace)
    with ExitStack() as stack:
        stack.callback(lambda: [process.communicate(timeout=60) for process in fresh])
        fleet.start()
        runs = {name: stack.enter_context(node_beside(QUIT, fleet.url, dist, name, stage, server_round))
                for name, stage, server_round in KILLS}
        runs["keep"] = stack.enter_context(node_beside(NODE_DEVICE, fleet.url, "--ort-web", dist, "--devices", 2,
                                                       "--name", "keep"))
        stack.callback(fleet.close)  # first on the way out: the devices that are left see the fleet close
        assert fleet.wait_for_devices(90)
        joined = {device.name: (device.node_id, device.partition) for device in fleet.connected}
        fleet.run(server)
    joined.update({r.device: (0, r.partition) for r in fleet.hub.ledger.receipts if r.device == "fresh-1"})
    return server, joined, {name: (run.process.returncode, run.stderr) for name, run in runs.items()}


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
def test_node_devices_killed_at_each_stage_are_recovered_and_below_the_threshold_the_round_halts(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, web = digits_folders
    server, joined, ends = _run(exported, web, tmp_path)
    assert {name: code for name, (code, _) in ends.items()} == {**{name: -9 for name, _, _ in KILLS}, "keep": 0}
    for name, stage, server_round in KILLS:  # each one SIGKILLed itself as its stage's frame came
        assert f"{name}: killed at {stage} of round {server_round}\n" == ends[name][1]
    first, second, third, fourth = server.history
    part = {name: partition for name, (_, partition) in joined.items()}

    def names(record: RoundRecord) -> dict[int, str]:
        """Who failed the round: each failure's device, whose connection was lost (not a refusal, not a timeout)."""
        lost = " closed its page or lost its connection (WebSocket close code "
        assert all(lost in reason for reason in record.failures.values()), record.failures
        return {node: reason.split(lost)[0] for node, reason in record.failures.items()}

    # Round 1: the share-keys victim and the collect victim failed; the four others' vectors count.
    assert names(first) == {joined["keys-1"][0]: "keys-1", joined["collect-1"][0]: "collect-1"}
    assert (first.halted, first.devices) == (None, 4)
    four = [part[n] for n in (*SURVIVORS, "unmask-2", "collect-3")]
    _assert_counted(web.directory, first, initial_values(exported), four, [*four, part["collect-1"]])
    # Round 2: the unmask victim's masked vector counts (its seed rebuilt from the others' shares).
    assert names(second) == {joined["unmask-2"][0]: "unmask-2"}
    assert (second.halted, second.devices) == (None, 4)
    after_first = checkpoint_values(round_path(tmp_path, 1))
    _assert_counted(web.directory, second, after_first, four, [p for p in four if p != part["unmask-2"]])
    # Round 3: below the threshold: one clear line, no file; round 4 starts from round 2's values.
    assert names(third) == {joined["collect-3"][0]: "collect-3"}
    assert (third.halted, third.checkpoint) == (HALTED, None)
    assert not round_path(tmp_path, 3).exists()
    assert (fourth.halted, fourth.devices, fourth.failures) == (None, 3, {})
    last = [part[n] for n in (*SURVIVORS, "fresh-1")]
    after_second = checkpoint_values(round_path(tmp_path, 2))
    _assert_counted(web.directory, fourth, after_second, last, last[:2])
    # The error replies reach the workflow at once: no round waits for the 60 s timeouts.
    assert max(record.seconds for record in server.history) < 10, [r.seconds for r in server.history]
