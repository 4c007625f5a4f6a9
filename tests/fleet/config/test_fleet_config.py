"""The fleet config in sections: the user's own model and data module, partitions, the one entry point.

examples/fleet_own_model.yaml trains examples/fleet_own_model.py's MLP factory on its breast-cancer
LightningDataModule from the command line; the accuracy it records is recomputed in plain torch
from the round's checkpoint. `run_fleet` returns what history.json holds, keeps Flower's log
quiet, and gives the same accuracy for the same seed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ort_lightning.errors import ConfigurationError
from tests._web import NODE_DEVICE, ROOT, ort_web_dist
from tests.helpers import RunIf

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')
pytest.importorskip("sklearn", reason="the example's data module reads scikit-learn's breast-cancer set")

from onnxruntime.training.api import CheckpointState  # noqa: E402

from ort_lightning.fleet import FleetConfig, run_fleet  # noqa: E402
from ort_lightning.fleet.data.partitions import partition_rows  # noqa: E402

EXAMPLE = ROOT / "examples" / "fleet_own_model.yaml"
sys.path.insert(0, str(EXAMPLE.parent))
from fleet_own_model import BreastCancer, mlp  # noqa: E402


def _torch_accuracy(checkpoint: Path) -> float:
    """The example's MLP with a round's values, measured in plain torch on the data module's validation set."""
    model = mlp(features=30, hidden=32, classes=2)
    values = {name: torch.as_tensor(np.array(p.data)) for name, p in
              CheckpointState.load_checkpoint(str(checkpoint)).parameters}
    model.load_state_dict(values)
    data = BreastCancer(seed=0)
    data.setup("fit")
    x, y = data.sets["val"].tensors
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


# ----------------------------------------------------------------------------- the user's own model and data
def test_the_own_model_example_trains_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ort_lightning.cli import main

    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # the example's module is found beside its config, not in the working folder
    assert main(["fleet", "--config", str(EXAMPLE), "--set", "devices.count=3", "--set", "rounds=2", "--set",
                 f"output.folder={out}", "--set", "model.verify=false"]) == 0
    shown = capsys.readouterr().out
    accuracies = [float(a) for a in re.findall(r"^round +\d: accuracy ([\d.]+)%", shown, re.MULTILINE)]
    assert len(accuracies) == 3, shown
    history = json.loads((out / "history.json").read_text(encoding="utf-8"))
    assert [r["devices"] for r in history["rounds"]] == [3, 3]
    assert history["config"]["data"]["class_path"] == "fleet_own_model:BreastCancer"
    last = history["rounds"][-1]
    assert last["accuracy"] == pytest.approx(_torch_accuracy(Path(last["checkpoint"])), abs=1e-6)
    assert last["accuracy"] > 0.9, shown


# ----------------------------------------------------------------------------- partitions
def test_partitions_cover_every_row_once_and_skew_as_alpha_says() -> None:
    labels = torch.arange(600) % 3
    for scheme in ("iid", "label", "dirichlet"):
        parts = partition_rows(labels, 5, scheme=scheme, alpha=0.5, seed=1)
        assert sorted(torch.cat(parts).tolist()) == list(range(600)), scheme
    assert all(len(set(labels[p].tolist())) <= 2 for p in partition_rows(labels, 5, scheme="label"))

    def spread(alpha: float) -> float:
        """Mean total-variation distance of the devices' label shares from the global one (1/3 each)."""
        parts = partition_rows(labels, 6, scheme="dirichlet", alpha=alpha, seed=0)
        shares = [torch.bincount(labels[p], minlength=3).double() / len(p) for p in parts]
        return float(sum((s - 1 / 3).abs().sum() / 2 for s in shares) / len(shares))

    assert spread(0.1) > 0.4 > 0.1 > spread(100.0)
    assert all(torch.equal(a, b) for a, b in zip(partition_rows(labels, 4, scheme="dirichlet", seed=3),
                                                  partition_rows(labels, 4, scheme="dirichlet", seed=3), strict=True))


class NoHeldOut(BreastCancer):
    """A data module without the server's batches."""

    val_dataloader = None  # type: ignore[assignment]


def test_partitions_refuse_what_cannot_be_cut(tmp_path: Path) -> None:
    labels = torch.arange(10) % 2
    with pytest.raises(ConfigurationError, match=r"Expected at most 10 devices for 10 training examples, but got 11"):
        partition_rows(labels, 11)
    with pytest.raises(ConfigurationError, match=r"Dirichlet\(0.01\) left a device without examples in 100 draws"):
        partition_rows(labels, 5, scheme="dirichlet", alpha=0.01)
    config = {**_own(tmp_path, seed=0), "data": {"class_path": f"{__name__}:NoHeldOut"}}
    with pytest.raises(ConfigurationError, match=r"Expected `data.class_path` .*NoHeldOut to define "
                                                 r"val_dataloader\(\) or test_dataloader\(\), the batches the global"):
        run_fleet(config, echo=False)


# ----------------------------------------------------------------------------- the config's refusals
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"hidden": 32}, r"`hidden` in the fleet config is a key of the flat fleet config, which has sections now; "
                         r"write `model.hidden` \(model: \{hidden: 32\}\)"),
        ({"devices": 3}, r"`devices` .* write `devices.count` \(devices: \{count: 3\}\)"),
        ({"engine": "simulation"}, r"`engine` .* write `engine.name` \(engine: \{name: 'ray'\}\)"),
        ({"strategy": {"optons": {}}}, r"Unknown key `strategy.optons` in the fleet config; did you mean "
                                       r"`strategy.options`\? Valid keys: \['name', 'options'\]"),
        ({"devices": {"lr": "fast"}}, r"Expected `devices.lr` to be float, but got 'fast' \(str\)"),
        ({"privacy": "on"}, r"Expected `privacy` to be a section \(a mapping of \['clip_norm_lr', "),
        ({"privacy": {"side": "both"}}, r"Expected `privacy.side` to be one of \[None, 'client', 'server'\]"),
        ({"model": {"factory": "m:f", "artifacts": "a"}}, r"Expected one of `model.factory` and `model.artifacts`"),
        ({"data": {"class_path": "m:D", "partition": "writers"}}, r"`data.partition: writers` with the bundled "),
        ({"data": {"alpha": 0}}, r"Expected `data.alpha` > 0, but got 0"),
        ({"rounds": 0}, r"Expected `rounds` >= 1, but got 0"),
    ],
    ids=["flat-key", "flat-section", "flat-engine", "typo-in-section", "type-in-section", "section-no-mapping",
         "choice", "factory-and-artifacts", "writers-need-digits", "alpha", "rounds"],
)
def test_config_mistakes_are_named_in_one_line(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as raised:
        FleetConfig.from_dict(values)
    assert "\n" not in str(raised.value)


def test_import_paths_are_named_when_they_do_not_resolve(tmp_path: Path) -> None:
    config = {"model": {"factory": "fleet_own_model:mlpp", "input_shape": [2, 30]},
              "data": {"class_path": "no_such_module.Data"}, "output": {"folder": str(tmp_path)}}
    with pytest.raises(ConfigurationError, match=r"`data.class_path: no_such_module.Data` names module "
                                                 r"'no_such_module', which is not found"):
        run_fleet(config, echo=False)
    config["data"] = {"class_path": "fleet_own_model:BreastCancer"}
    with pytest.raises(ConfigurationError, match=r"`model.factory: fleet_own_model:mlpp` names 'mlpp', which "
                                                 r"module fleet_own_model does not define"):
        run_fleet(config, echo=False)


# ----------------------------------------------------------------------------- the one entry point
def _own(folder: Path, seed: int) -> dict[str, Any]:
    model = {"factory": "fleet_own_model:mlp", "init_args": {"hidden": 8}, "verify": False}
    return {"rounds": 1, "seed": seed, "model": model,
            "data": {"class_path": "fleet_own_model:BreastCancer", "partition": "iid"},
            "devices": {"count": 2, "batch_size": 32}, "output": {"folder": str(folder), "plot": False}}


def test_run_fleet_returns_the_history_quietly_and_a_seed_gives_the_same_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    first = run_fleet(_own(tmp_path / "a", seed=0))
    shown = capfd.readouterr()
    assert first == json.loads((tmp_path / "a" / "history.json").read_text(encoding="utf-8"))
    assert re.search(r"^round  1: accuracy [\d.]+%", shown.out, re.MULTILINE), shown.out
    # Flower's own log (INFO lines, colour codes, its warning about fraction_evaluate=0.0) stays out
    assert "\x1b[" not in shown.out + shown.err, shown
    assert not re.search(r"WARNING|INFO", shown.err), shown.err
    changed = _own(tmp_path / "a", seed=0)
    changed["model"]["init_args"] = {"hidden": 16}  # the folder's export is of hidden 8: refused, not reused
    with pytest.raises(ConfigurationError, match=r"a/artifacts was exported from another `model` section or seed"):
        run_fleet(changed, echo=False)
    again = run_fleet(FleetConfig.from_dict(_own(tmp_path / "b", seed=0)), echo=False)
    other = run_fleet(_own(tmp_path / "c", seed=1), echo=False)
    assert [r["loss"] for r in again["rounds"]] == [r["loss"] for r in first["rounds"]]
    assert [r["accuracy"] for r in again["rounds"]] == [r["accuracy"] for r in first["rounds"]]
    assert other["rounds"][0]["loss"] != first["rounds"][0]["loss"]  # the seed reaches the model and the data


#: What `ort-lightning fleet` may print: its header, the round lines, the total and the files it wrote.
PRINTED = re.compile(r"\d+ devices, .* engine|round +\d+: accuracy .*|total: .*|round checkpoints: .*|history: .*|"
                     r"plot: .*|device folder: .*")


def _round_values(folder: Path) -> dict[str, np.ndarray]:
    return {name: np.array(p.data) for name, p in
            CheckpointState.load_checkpoint(str(folder / "rounds" / "round-0001.ortckpt")).parameters}


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The own model's fleet on the Ray engine by the console script, as a user runs it: its folder and output.

    NOTE: one Ray start for this file's Ray tests (each start costs seconds of processes importing torch).
    """
    folder = tmp_path_factory.mktemp("ray")
    config = folder / "fleet.yaml"
    config.write_text(json.dumps({**_own(folder / "run", seed=0), "engine": {"name": "ray"}}), encoding="utf-8")
    # the example's module from its folder, as the command finds it beside examples/fleet_own_model.yaml
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLE.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([str(Path(sys.executable).with_name("ort-lightning")), "fleet", "--config", str(config)],
                            capture_output=True, text=True, cwd=folder, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder / "run", result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.alone  # Ray
def test_the_own_model_trains_on_the_ray_engine_as_in_process(ray_run: tuple[Path, str], tmp_path: Path) -> None:
    ray = json.loads((ray_run[0] / "history.json").read_text(encoding="utf-8"))
    local = run_fleet(_own(tmp_path / "local", seed=0), echo=False)
    assert [r["devices"] for r in ray["rounds"]] == [2]
    assert ray["rounds"][0]["loss"] == pytest.approx(local["rounds"][0]["loss"], abs=1e-6)
    assert ray["rounds"][0]["accuracy"] == local["rounds"][0]["accuracy"]


@pytest.mark.slow
@pytest.mark.alone  # Ray
def test_the_ray_engine_prints_the_round_lines_alone_and_equals_the_local_engine(
    ray_run: tuple[Path, str], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from ort_lightning.cli import main

    config = tmp_path / "local.yaml"
    config.write_text(json.dumps({**_own(tmp_path / "local", seed=0), "engine": {"name": "local"}}), encoding="utf-8")
    assert main(["fleet", "--config", str(config)]) == 0
    local = capfd.readouterr()
    shown = {"ray": ray_run[1], "local": local.out + local.err}
    for text in shown.values():
        noise = [line for line in text.splitlines() if line.strip() and not PRINTED.fullmatch(line)]
        assert not noise, text
    accuracy = [re.findall(r"accuracy ([\d.]+)%", text) for text in shown.values()]
    assert len(accuracy[0]) == 2, shown  # round 0 and round 1
    assert accuracy[0] == accuracy[1], shown
    local_values = _round_values(tmp_path / "local")
    for name, value in _round_values(ray_run[0]).items():
        np.testing.assert_allclose(value.astype(np.float64), local_values[name], rtol=0, atol=1e-6, err_msg=name)


@RunIf(node=True)
@pytest.mark.slow
@pytest.mark.spread
def test_the_own_model_trains_on_node_devices_as_in_process(tmp_path: Path) -> None:
    node, dist = shutil.which("node"), ort_web_dist()
    assert node is not None
    assert dist is not None
    config = tmp_path / "fleet.yaml"
    sections = {**_own(tmp_path / "nodes", seed=0), "engine": {"name": "browser", "port": 0, "ort_web": dist}}
    config.write_text(json.dumps(sections), encoding="utf-8")
    command = [sys.executable, "-c", "import sys; from ort_lightning.cli import main; sys.exit(main())", "fleet",
               "--config", str(config)]
    fleet = subprocess.Popen(command, cwd=EXAMPLE.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert fleet.stdout is not None
    lines = []
    for line in fleet.stdout:
        lines.append(line)
        if line.strip().startswith("http"):
            break
    url = lines[-1].strip()
    devices = subprocess.run([node, "--experimental-websocket", str(NODE_DEVICE), url, "--ort-web", dist,
                              "--devices", "2"], capture_output=True, text=True, timeout=240, check=False)
    output = "".join(lines) + fleet.stdout.read()
    assert fleet.wait(timeout=60) == 0, output
    assert devices.returncode == 0, devices.stdout + devices.stderr
    nodes = json.loads((tmp_path / "nodes" / "history.json").read_text(encoding="utf-8"))
    local = run_fleet(_own(tmp_path / "local", seed=0), echo=False)
    assert [r["devices"] for r in nodes["rounds"]] == [2]
    assert nodes["rounds"][0]["loss"] == pytest.approx(local["rounds"][0]["loss"], rel=1e-3)
    assert nodes["rounds"][0]["accuracy"] == pytest.approx(local["rounds"][0]["accuracy"], abs=1.01 / 114)


def test_the_ray_engine_calls_flowers_deprecated_run_simulation() -> None:
    """`engine.name: ray` runs on ``flwr.simulation.run_simulation`` (CONTRIBUTING.md says why not ``flwr run``)."""
    import inspect

    from flwr.simulation import run_simulation

    import ort_lightning.fleet.run as run

    taken = set(inspect.signature(run_simulation).parameters)
    assert {"server_app", "client_app", "num_supernodes", "backend_config"} <= taken, taken
    assert "run_simulation(" in inspect.getsource(run)


def test_the_config_names_the_strategies_the_server_builds() -> None:
    from ort_lightning.fleet.config.fleet_config import STRATEGIES
    from ort_lightning.fleet.server import strategies

    assert set(STRATEGIES) == set(strategies.STRATEGIES)
    assert {"fixed", "adaptive"} == {clipping for _, clipping in strategies.PRIVACY}
