"""Browsers as fleet devices: real headless Chromium pages train the rounds that Flower's FedAvg aggregates.

The reference never goes through ort_lightning.fleet: each device's round is ONNX Runtime's
documented Python loop (``CheckpointState`` / ``Module`` / ``Optimizer``) on the same device files,
from the round's weights over that device's batches, and the average is taken here, in float64,
weighted by each device's example count. The fleet's round checkpoints are read with ORT's own
``CheckpointState``. One Chromium process per device, each with a fresh profile; closing a tab is
killing its process.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from ort_lightning import TrainingArtifacts
from ort_lightning.errors import BatchError, ConfigurationError, DeviceReplyError
from tests._web import ROOT, ort_web_dist
from tests.conftest import Exported
from tests.helpers import RunIf

flwr = pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from ort_lightning.fleet import BrowserFleet  # noqa: E402
from ort_lightning.fleet.data.digits import DigitsPartitions, digits_test_loader  # noqa: E402
from ort_lightning.fleet.devices.frames import pack, read_result, train_frame, unpack  # noqa: E402
from ort_lightning.fleet.run import FleetConfig, run_experiment  # noqa: E402
from tests.fleet.engines.browser.chromium import chromium, kill_browser  # noqa: E402
from tests.fleet.engines.browser.digits_rounds import (  # noqa: E402
    BROWSER_ATOL,
    DATA,
    DEVICES,
    ROUNDS,
    assert_round,
    checkpoint_values,
    fedavg_server,
    initial_values,
    reference_rounds,
)

pytestmark = [pytest.mark.slow, pytest.mark.spread]


# ----------------------------------------------------------------------------- browsers
def _fleet(web: TrainingArtifacts, *, devices: int = DEVICES, device_timeout: float = 60.0) -> BrowserFleet:
    return BrowserFleet(web, DATA, port=0, devices=devices, device_timeout=device_timeout, ort_web=ort_web_dist())


# ----------------------------------------------------------------------------- the tests
def _fleet_command(config: dict[str, object], folder: Path, *extra: str) -> list[str]:
    """``ort-lightning fleet --config <folder>/fleet.yaml ...`` as a user runs it, on this checkout."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fleet.yaml").write_text(yaml.safe_dump({**config, "output": {"folder": str(folder)}}))
    return [sys.executable, "-c", "import sys; from ort_lightning.cli import main; sys.exit(main())",
            "fleet", "--config", str(folder / "fleet.yaml"), *extra]


def _accuracies(folder: Path) -> list[float]:
    return [record["accuracy"] for record in json.loads((folder / "history.json").read_text())["rounds"]]


#: The README's browser command, `ort-lightning fleet --config examples/fleet_digits.yaml --browsers --set
#: devices.count=3 --set rounds=2`, on the example config as written (epochs: 2), equal to ORT's loop at that count;
#: the same device.js at 1, 2 and 3 epochs is tests/fleet/devices/test_fleet_device.py's Node test.
EXAMPLE = ROOT / "examples" / "fleet_digits.yaml"


@RunIf(chromium=True)
def test_the_readme_command_runs_three_browsers_as_the_simulated_fleet_does(tmp_path: Path) -> None:
    written = yaml.safe_load(EXAMPLE.read_text())
    epochs = written["devices"]["epochs"]
    assert epochs > 1  # so that a page that ran one epoch whatever it was told would fail
    config = {**written, "devices": {**written["devices"], "count": DEVICES, "epochs": epochs}, "rounds": ROUNDS,
              "engine": {"port": 0, "ort_web": ort_web_dist()}}
    browsers = tmp_path / "browsers"
    command = subprocess.Popen(_fleet_command(config, browsers, "--browsers"), cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    assert command.stdout is not None
    lines = []
    for line in command.stdout:
        lines.append(line)
        if line.strip().startswith("http://"):
            break
    url = lines[-1].strip()
    with chromium({n: f"{url}&name={n}" for n in ("a", "b", "c")}):
        output = "".join(lines) + command.stdout.read()
        assert command.wait(timeout=240) == 0, output
    # one line per event: each join once
    assert len(re.findall(r"round 0: a joined from 127\.0\.0\.1:\d+ \(partition \d of 3\)", output)) == 1, output
    assert output.count(" joined") == 3, output
    assert re.search(r"round  2: accuracy [\d.]+%", output)
    # ONNX Runtime's own loop on the device folder the browsers loaded, from the server's initial weights
    data = DigitsPartitions(split=written["data"]["partition"], batch_size=written["devices"]["batch_size"],
                            seed=written["seed"])
    expected = reference_rounds(browsers / "device", checkpoint_values(browsers / "artifacts" / "checkpoint"),
                          [[0, 1, 2]] * ROUNDS, epochs=epochs, data=data)
    # the simulated fleet of the same config (ONNX Runtime's device loop on the same device folder)
    local = FleetConfig.from_dict({**config, "engine": {"name": "local"},
                                   "output": {"folder": str(tmp_path / "simulated")}})
    simulated = run_experiment(local, browsers / "artifacts", data, test=digits_test_loader(local.seed), echo=False)
    for number, average in enumerate(expected, start=1):
        browser_round = browsers / "rounds" / f"round-{number:04d}.ortckpt"
        simulated_round = tmp_path / "simulated" / "rounds" / f"round-{number:04d}.ortckpt"
        # NOTE: the stated tolerance for the simulated fleet too: after two rounds a weight whose gradient is near zero
        # (a pixel that is almost always blank) takes AdamW steps whose sign follows the last bits of its average.
        assert_round(browser_round, average, atol=BROWSER_ATOL)
        assert_round(simulated_round, average, atol=BROWSER_ATOL)
        assert_round(browser_round, checkpoint_values(simulated_round), atol=BROWSER_ATOL)
    accuracies = _accuracies(browsers)
    assert accuracies == [record.evaluation["accuracy"] for record in simulated.history]
    assert accuracies[-1] > simulated.initial["accuracy"]


class _KillWhenSent(logging.Handler):
    """Kills a browser's process once the server has sent it the weights of `server_round`."""

    def __init__(self, device: str, server_round: int, process: subprocess.Popen[bytes]) -> None:
        super().__init__(logging.DEBUG)
        self.pattern = f"round {server_round}: sent "
        self.device, self.process = device, process
        self.killed = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.pattern) and message.endswith(f" to {self.device}"):
            kill_browser(self.process)
            self.killed.set()


@RunIf(chromium=True)
def test_a_browser_closed_during_round_two_leaves_the_round_to_the_other_two(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, web = digits_folders
    logger = logging.getLogger("ort_lightning.fleet.engines.browser")
    # NOTE: the hub logs "sent" before the frame goes out, and the handler kills the process before it returns:
    # the page dies owing round 2, before it could answer it.
    urls = {"a": "&name=a", "b": "&name=b", "c": "&name=c"}
    with _fleet(web) as fleet, chromium({n: fleet.url + q for n, q in urls.items()}) as browsers:
        killer = _KillWhenSent("c", 2, browsers["c"])
        level = logger.level
        logger.addHandler(killer)
        logger.setLevel(logging.DEBUG)
        try:
            fleet.start().wait_for_devices(90)
            held = next(device.partition for device in fleet.connected if device.name == "c")
            server = fleet.run(fedavg_server(exported, tmp_path), join_timeout=1)
        finally:
            logger.removeHandler(killer)
            logger.setLevel(level)
    assert killer.killed.is_set()
    assert [(r.server_round, r.devices) for r in server.history] == [(1, 3), (2, 2)]
    [refusal] = fleet.refusals
    assert (refusal.device, refusal.server_round) == ("c", 2)
    assert "c closed its page or lost its connection" in refusal.reason
    others = [p for p in range(DEVICES) if p != held]
    expected = reference_rounds(web.directory, initial_values(exported), [[0, 1, 2], others])
    for record, average in zip(server.history, expected, strict=True):
        assert_round(record.checkpoint, average)


# ----------------------------------------------------------------------------- devices that misbehave
def _bad_device(fleet: BrowserFleet, name: str, behaviour: str, closed: dict[str, tuple[int, str]]) -> None:
    """A device speaking the page's protocol from Python, which answers its round as `behaviour` says."""
    url = fleet.url.replace("http://", "ws://").replace("/?token=", "/join?token=") + f"&name={name}"
    parameters = fleet.hub.parameters + (1 if behaviour == "other-model" else 0)
    with connect(url, max_size=None) as socket:
        try:
            json.loads(socket.recv())  # welcome
            socket.send(json.dumps({"type": "ready", "parameters": parameters, "identity": f"python-device-{name}"}))
            assert json.loads(socket.recv())["type"] == "admitted"  # a refused device's socket closes instead
            header, payload = unpack(socket.recv())  # the round
            weights = np.frombuffer(payload[: 4 * fleet.hub.parameters], dtype=np.float32).copy()
            examples = header["examples"] + (1 if behaviour == "greedy" else 0)
            weights[3] = np.nan if behaviour == "nan" else weights[3]
            result = {"type": "result", "id": header["id"], "examples": examples, "steps": 1, "losses": [1.0]}
            if behaviour == "huge":
                socket.send(pack(result, [np.zeros(fleet.frame_limit // 4 + 1, np.float32)]))
            elif behaviour != "silent":
                socket.send(pack(result, [weights[:-1] if behaviour == "short" else weights]))
            socket.recv(timeout=120)
        except ConnectionClosed as error:
            closed[name] = (error.rcvd.code, error.rcvd.reason) if error.rcvd else (0, "")


@RunIf(chromium=True)
def test_bad_devices_are_refused_by_name_and_the_round_completes_with_the_browsers(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    exported, web = digits_folders
    bad = {"nan": r"nan sent 1 non-finite weights \(NaN or infinite, the first at index 3\)",
           "short": r"short sent \d+ bytes of weights \(\d+ float32 values\), but the model has \d+ parameters",
           "greedy": r"greedy claims \d+ examples, but it was given \d+ per epoch",
           "huge": r"huge sent a frame over the size limit of \d+ bytes",
           "silent": r"silent did not answer round 1 within the device timeout of 15 s"}
    closed: dict[str, tuple[int, str]] = {}
    devices = 2 + len(bad)
    with _fleet(web, devices=devices, device_timeout=15) as fleet, chromium({n: f"{fleet.url}&name={n}"
                                                                                for n in ("a", "b")}):
        with pytest.raises(urllib.error.HTTPError, match="403") as page:
            urllib.request.urlopen(fleet.url.replace("token=", "token=x"))
        assert "join token is missing or wrong" in page.value.read().decode()
        threads = [threading.Thread(target=_bad_device, args=(fleet, name, name, closed)) for name in bad]
        for thread in threads:
            thread.start()
        assert fleet.wait_for_devices(90)
        for name, behaviour in [("other-model", "other-model"), ("late", "late")]:
            _bad_device(fleet, name, behaviour, closed)
        wrong = fleet.url.replace("token=", "token=x").replace("http://", "ws://").replace("/?", "/join?")
        with connect(wrong) as socket, pytest.raises(ConnectionClosed) as refused:
            socket.recv(timeout=30)
        partitions = {device.name: device.partition for device in fleet.connected}
        server = fleet.run(fedavg_server(exported, tmp_path, devices=devices, rounds=1), join_timeout=1)
        for thread in threads:
            thread.join(timeout=60)
    assert refused.value.rcvd is not None
    assert refused.value.rcvd.code == 1008
    assert "wrong join token" in refused.value.rcvd.reason
    assert [(r.server_round, r.devices) for r in server.history] == [(1, 2)]
    reasons = {refusal.device: refusal.reason for refusal in fleet.refusals}
    assert sorted(reasons) == sorted([*bad, "other-model", "late"])
    assert re.search(r"other-model opened a model of \d+ parameters, but the fleet's has \d+", reasons["other-model"])
    assert re.search(r"late found the fleet full: 7 devices are connected, its most", reasons["late"])
    for name, pattern in bad.items():
        assert re.search(pattern, reasons[name]), (name, reasons[name])
        assert closed[name][0] in (1008, 1009), (name, closed[name])
    chosen = [[partitions["a"], partitions["b"]]]
    [expected] = reference_rounds(web.directory, initial_values(exported), chosen, devices)
    assert_round(server.history[0].checkpoint, expected)


# ----------------------------------------------------------------------------- refusals without a browser
CDN = "https://cdn.jsdelivr.net/npm/onnxruntime-web@1.19.2/dist"  # returned as given, never fetched


def _result(examples: int = 8, **header: object) -> dict[str, object]:
    return {"type": "result", "id": "m", "examples": examples, "steps": 2, "losses": [0.5, 0.4], **header}


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (pack(_result(), [np.zeros(9, np.float32)]), r"d sent 36 bytes of weights \(9 float32 values\), but the model "
                                                     r"has 10 parameters; the device is refused"),
        (pack(_result(), [np.array([0.0] * 4 + [np.inf] + [0.0] * 5, np.float32)]),
         r"d sent 1 non-finite weights \(NaN or infinite, the first at index 4\); the device is refused"),
        (pack(_result(examples=9), [np.zeros(10, np.float32)]), r"d claims 9 examples, but it was given 8 per epoch; "
                                                               r"a device may claim 1 to 8"),
        (pack(_result(examples=0), [np.zeros(10, np.float32)]), r"d claims 0 examples"),
        (pack(_result(examples="8"), [np.zeros(10, np.float32)]), r"d sent examples='8', but a count"),
        (b"\xff\xff\x00\x00{}", r"d sent a frame whose header claims 65535 bytes, but at most 2 are allowed"),
        (b"\x02\x00\x00\x00[]", r"d sent a frame header that is a list, not a JSON object"),
        (b"\x01", r"d sent a binary frame of 1 bytes, shorter than its 4-byte header length"),
    ],
    ids=["short", "infinite", "more-examples", "no-examples", "examples-not-a-count", "header-too-long",
         "not-an-object", "truncated"],
)
def test_a_result_that_fails_a_check_is_refused_before_the_strategy(frame: bytes, message: str) -> None:
    with pytest.raises(DeviceReplyError, match=message):
        read_result(*unpack(frame, device="d"), device="d", parameters=10, given=8)


def test_a_batch_of_a_dtype_the_browser_does_not_take_is_refused() -> None:
    with pytest.raises(BatchError, match=r"takes tensors of dtype \['bool', 'float32', 'int32', 'int64'\], but a batch "
                                         r"holds torch.float64; convert it in your Dataset"):
        train_frame("m", 1, np.zeros(3, np.float32), [[(torch.zeros(2, 4, dtype=torch.float64),)]])


def test_fleet_options_and_mismatched_servers_are_refused(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], mlp_adamw: Exported, tmp_path: Path
) -> None:
    _, web = digits_folders
    with pytest.raises(ConfigurationError, match=r"Expected devices >= 1, epochs >= 1 and device_timeout > 0, but "
                                                 r"got 0, 1 and 600.0"):
        BrowserFleet(web, DATA, devices=0, ort_web=CDN)
    with BrowserFleet(web, DATA, port=0, devices=1, ort_web=CDN) as fleet:
        with pytest.raises(ConfigurationError, match=r"The FleetServer's model has the state \{'fc1.weight'.*but the "
                                                     r"browsers' folder .* trains \{'0.weight'.*build both from the "
                                                     r"same export"):
            fleet.run(fedavg_server(mlp_adamw.artifacts, tmp_path / "other", devices=1))
        # NOTE: the message names no URL: the token it holds belongs in no error that may reach a log.
        with pytest.raises(ConfigurationError, match=r"0 of 1 browsers joined within 0.2 s; open the fleet's URL in 1 "
                                                     r"browsers \(tabs\), or pass fewer min_devices"):
            fleet.run(fedavg_server(digits_folders[0], tmp_path / "none", devices=1), join_timeout=0.2)


def test_a_folder_without_an_optimizer_graph_and_keep_with_browsers_are_refused(
    digits_folders: tuple[TrainingArtifacts, TrainingArtifacts], tmp_path: Path
) -> None:
    folder = tmp_path / "no-optimizer"
    shutil.copytree(digits_folders[0].directory, folder)
    for name in ("ort_lightning.json", "optimizer_model.onnx", "optimizer_model.ort", "training_model.ort",
                 "eval_model.ort"):
        (folder / name).unlink()
    with pytest.raises(ConfigurationError, match=r"no-optimizer has no optimizer graph, but a device trains with one"):
        BrowserFleet(folder, DATA, port=0, ort_web=CDN)
    with pytest.raises(ConfigurationError, match=r"Expected `devices.optimizer_state: fresh` with `engine.name: "
                                                 r"browser`, but got \"keep\": a browser returns its weights only"):
        FleetConfig.from_dict({"engine": {"name": "browser"}, "devices": {"optimizer_state": "keep"}})
