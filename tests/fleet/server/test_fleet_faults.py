"""A fleet with a device that hangs: the round ends at the device timeout and aggregates the others.

The reference is tests/fleet/test_fleet.py's: independent Lightning + ORT fits of the answering devices
from the same start, averaged here by example count in float64.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset

from ort_lightning.errors import ConfigurationError
from tests.conftest import Exported

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.serverapp.strategy import FedAvg  # noqa: E402

from ort_lightning.fleet import ClientData, DeviceClient, FleetServer, GlobalModel, round_path, run_local  # noqa: E402
from ort_lightning.fleet.run import FleetConfig  # noqa: E402
from tests.fleet.fedavg_by_hand import (  # noqa: E402
    EPOCHS,
    LR,
    SIZES,
    assert_values_close,
    fedavg_by_hand,
    iid_data,
    values_in,
)

pytestmark = pytest.mark.slow

DEVICE_TIMEOUT = 3.0
HUNG = 1  # the partition whose data loader blocks
#: Released when the test ends, so that the abandoned device's thread returns instead of lingering.
RELEASE = threading.Event()


class Blocking(Dataset):
    """A dataset whose first item waits far longer than the device timeout (a device stuck in its data)."""

    def __init__(self, data: Dataset) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        RELEASE.wait(timeout=120)
        return self.data[index]


def hung_data(partition: int, partitions: int) -> ClientData:
    data = iid_data(partition, partitions)
    if partition != HUNG:
        return data
    return ClientData(train=DataLoader(Blocking(data.train.dataset), batch_size=4))


@pytest.fixture
def release() -> Any:
    RELEASE.clear()
    yield RELEASE
    RELEASE.set()


def test_a_hung_device_fails_its_round_and_the_round_averages_the_other_two(
    mlp_adamw: Exported, device_folder: Any, tmp_path: Path, release: threading.Event
) -> None:
    client = DeviceClient(device_folder(mlp_adamw.artifacts, LR), hung_data, epochs=EPOCHS, runner="lightning")
    server = FleetServer(GlobalModel(mlp_adamw.artifacts), FedAvg(fraction_evaluate=0.0), rounds=2,
                         directory=tmp_path / "rounds", device_timeout=DEVICE_TIMEOUT)
    started = time.perf_counter()
    run_local(server.server_app(), client.client_app(), nodes=len(SIZES))
    seconds = time.perf_counter() - started

    # round 1 waits out the timeout once; round 2 refuses the still-running node at once
    assert seconds < DEVICE_TIMEOUT + 30, seconds
    assert server.history[1].seconds < DEVICE_TIMEOUT, server.history[1].seconds
    node = HUNG + 1  # LocalGrid's node ids count from 1
    assert [(r.devices, r.examples) for r in server.history] == [(2, SIZES[0] + SIZES[2])] * 2
    assert list(server.history[0].failures) == [node]
    assert re.search(rf"node {node} did not answer within the device timeout of 3 s", server.history[0].failures[node])
    assert re.search(rf"node {node} is still running a message", server.history[1].failures[node])

    expected = fedavg_by_hand(mlp_adamw, iid_data, [[0, 2], [0, 2]], tmp_path)
    for number, (average, _) in enumerate(expected, start=1):
        assert_values_close(values_in(mlp_adamw, round_path(tmp_path / "rounds", number)), average)
    # the test can fail: with the hung device's data the average would differ
    (with_all, _), = fedavg_by_hand(mlp_adamw, iid_data, [[0, 1, 2]], tmp_path / "all")
    assert float((with_all["fc1.weight"] - expected[0][0]["fc1.weight"]).abs().max()) > 1e-4


def test_device_timeout_must_be_positive(mlp_adamw: Exported, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"Expected `device_timeout` > 0 seconds .*, but got 0"):
        FleetServer(GlobalModel(mlp_adamw.artifacts), FedAvg(), rounds=1, directory=tmp_path, device_timeout=0)
    with pytest.raises(ConfigurationError, match=r"Expected `devices.timeout` > 0 seconds or null .*, but got -1"):
        FleetConfig.from_dict({"devices": {"timeout": -1}})


# ----------------------------------------------------------------------------- config keys and --set
def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_set_overrides_keys_of_the_file_with_their_types(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "devices: {count: 4, lr: 0.01}\nrounds: 5\n")
    config = FleetConfig.from_yaml(path, overrides=["rounds=3", "devices.lr=0.05", "strategy.options={eta: 0.1}",
                                                    "devices.timeout=null"])
    assert (config.devices.count, config.rounds, config.devices.lr, config.devices.timeout) == (4, 3, 0.05, None)
    assert config.strategy.options == {"eta": 0.1}
    assert FleetConfig.from_yaml(path).rounds == 5

    def waits(**devices: int) -> int:
        return FleetConfig.from_dict({"devices": devices}).nodes_to_wait_for

    assert (waits(count=4), waits(count=1)) == (3, 1)
    assert [waits(count=4, min_nodes=n) for n in (4, 0)] == [4, 3]


@pytest.mark.parametrize(
    ("text", "overrides", "message"),
    [
        ("round: 3\n", [], r"Unknown key `round` in the fleet config .*fleet\.yaml; did you mean `rounds`\?"),
        ("rounds: 3\n", ["devices.ecochs=2"], r"Unknown key `devices.ecochs` in --set; did you mean "
         r"`devices.epochs`\?"),
        ("rounds: 3\n", ["colour=red"], r"Unknown key `colour` in --set; valid keys: \['data', 'devices', "),
        ("rounds: 3\n", ["rounds=three"], r"Expected `rounds` to be int, but got 'three' \(str\); fix that key"),
        ("devices: {lr: fast}\n", [], r"Expected `devices.lr` to be float, but got 'fast' \(str\); fix that key in "
         r"the fleet config"),
        ("rounds: 3\n", ["devices.timeout=yes"], r"Expected `devices.timeout` to be float or null, but got True"),
        ("rounds: 3\n", ["rounds"], r"Expected --set KEY=VALUE, but got 'rounds'; write e\.g\. --set devices.count=3"),
        ("rounds: 3\n", ["strategy.options={eta"], r"The value of --set 'strategy.options=\{eta' is not a YAML"),
        ("devices: {count: 3}\n", ["devices.min_nodes=4"],
         r"`devices.min_nodes` between 1 and devices.count \(3\), or 0 or null .*, but got 4"),
    ],
    ids=["unknown-in-file", "unknown-override", "nothing-close", "override-type", "file-type", "bool-is-no-number",
         "no-equals", "bad-yaml", "min-nodes"],
)
def test_config_keys_and_overrides_are_checked(tmp_path: Path, text: str, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        FleetConfig.from_yaml(_yaml(tmp_path, text), overrides=overrides)


def test_fleet_command_takes_set_and_names_a_misspelt_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ort_lightning.cli import main

    path = _yaml(tmp_path, f"output: {{folder: {tmp_path / 'run'}}}\ndevices: {{count: 2, epochs: 1}}\nrounds: 5\n"
                           "model: {hidden: 8, verify: false}\n")
    # in this process: the console script as a child is tests/fleet/test_fleet.py's
    assert main(["fleet", "--config", str(path), "--set", "rounds=1", "--set", "devices.batch_size=64"]) == 0
    shown = capsys.readouterr().out
    assert re.findall(r"^round +(\d+): accuracy", shown, re.MULTILINE) == ["0", "1"], shown
    # the refusal from the entry point in this process (tests/cli/test_cli.py runs the script's errors as children)
    assert main(["fleet", "--config", str(path), "--set", "round=1"]) == 2
    error = capsys.readouterr().err
    assert re.fullmatch(r"ort-lightning: error: ConfigurationError: Unknown key `round` in --set; did you mean "
                        r"`rounds`\? Valid keys: \[.*\]\.\n", error), error
