"""The distribution's promises: dependency bounds, extras, and the error without ONNX Runtime."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import ROOT

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirement(name: str, requirements: list[str]) -> Requirement:
    matches = [Requirement(text) for text in requirements if Requirement(text).name == name]
    assert len(matches) == 1, f"expected one requirement on {name}, found {matches}"
    return matches[0]


def test_torch_bound_is_satisfied_by_the_cpu_wheel_on_disk() -> None:
    # An open lower bound that 2.13.0 satisfies: pip keeps the installed CPU build.
    assert _requirement("torch", PROJECT["dependencies"]).specifier.contains("2.13.0")


def test_onnx_is_pinned_below_ir_11() -> None:
    spec = _requirement("onnx", PROJECT["dependencies"]).specifier
    assert spec.contains("1.17.0")
    assert not spec.contains("1.18.0")


@pytest.mark.parametrize(
    ("extra", "package"),
    [("cpu", "onnxruntime-training-cpu"), ("cuda", "onnxruntime-training")],
    ids=["cpu", "cuda"],
)
def test_onnxruntime_training_extras_pin_1_19_2(extra: str, package: str) -> None:
    requirement = _requirement(package, PROJECT["optional-dependencies"][extra])
    assert str(requirement.specifier) == "==1.19.2"


def test_requires_python_matches_the_training_wheels() -> None:
    spec = Requirement(f"x{PROJECT['requires-python']}").specifier
    assert spec.contains("3.11")
    assert spec.contains("3.12")
    assert not spec.contains("3.13")


@pytest.mark.parametrize(
    ("extra", "package", "pythons", "refused"),
    [("cpu", "onnxruntime-training-cpu", ["3.10", "3.11", "3.12"], []),
     ("cuda", "onnxruntime-training", ["3.10", "3.11"], ["3.12"])],
    ids=["cpu", "cuda"],
)
def test_extras_install_only_where_wheels_exist(
    extra: str, package: str, pythons: list[str], refused: list[str]
) -> None:
    # The wheels of 1.19.2 (the last release): CPU build for CPython <= 3.12, CUDA build for <= 3.11.
    requirement = _requirement(package, PROJECT["optional-dependencies"][extra])
    for version in pythons:
        assert requirement.marker is None or requirement.marker.evaluate({"python_version": version}), version
    for version in refused:
        assert requirement.marker is not None
        assert not requirement.marker.evaluate({"python_version": version}), version


def test_notebooks_extra_names_what_the_notebooks_import() -> None:
    names = {Requirement(text).name for text in PROJECT["optional-dependencies"]["notebooks"]}
    assert {"nbclient", "nbformat", "ipykernel", "matplotlib", "scikit-learn", "torchmetrics"} <= names


#: What the README's set-up installs: every section and page can count on these.
QUICK_START_EXTRAS = ("cpu", "cli")


def _distributions_imported(block: str) -> set[str]:
    """The distributions that provide the top-level imports of a Python block (stdlib left out)."""
    from importlib.metadata import packages_distributions

    roots: set[str] = set()
    for node in ast.walk(ast.parse(block)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            roots.add(node.module.split(".")[0])
    providers = packages_distributions()
    names = {name for root in roots - set(sys.stdlib_module_names) for name in providers.get(root, [root])}
    return {canonicalize_name(name) for name in names}


def _provided_by(extras: set[str]) -> set[str]:
    texts = [*PROJECT["dependencies"], *(text for extra in extras for text in PROJECT["optional-dependencies"][extra])]
    return {canonicalize_name(Requirement(text).name) for text in texts} | {canonicalize_name(PROJECT["name"])}


def _readme_sections_and_docs_pages() -> list[tuple[str, str]]:
    """Each README section, and each page under docs/ whole: the units that name the extras their code needs."""
    readme = (ROOT / "README.md").read_text()
    sections = [(f"README section {text.splitlines()[0]!r}", text) for text in readme.split("\n## ")]
    pages = [(path.relative_to(ROOT).as_posix(), path.read_text()) for path in sorted((ROOT / "docs").rglob("*.md"))]
    return sections + pages


def test_every_readme_section_and_docs_page_installs_what_its_python_blocks_import() -> None:
    checked = []
    for name, text in _readme_sections_and_docs_pages():
        blocks = re.findall(r"```python[^\n]*\n(.*?)```", text, re.DOTALL)
        installs = re.findall(r'pip install -e "\.\[([\w,]+)\]"', text)
        named = {extra for group in installs for extra in group.split(",")}
        needed = set().union(*map(_distributions_imported, blocks)) if blocks else set()
        missing = needed - _provided_by({*QUICK_START_EXTRAS, *named})
        assert not missing, f"{name} imports {sorted(missing)}; name an extra"
        checked.append(name)
    assert "docs/guide/huggingface.md" in checked


def test_hf_extra_pins_transformers_as_the_tests_do() -> None:
    extras = PROJECT["optional-dependencies"]
    assert str(_requirement("transformers", extras["hf"])) == str(_requirement("transformers", extras["test"]))


def test_fleet_extra_draws_the_accuracy_plot_and_cli_extra_has_the_configs_metrics() -> None:
    extras = PROJECT["optional-dependencies"]
    assert str(_requirement("matplotlib", extras["fleet"])) == str(_requirement("matplotlib", extras["notebooks"]))
    assert str(_requirement("torchmetrics", extras["cli"])) == str(_requirement("torchmetrics", extras["test"]))
    for config in ("digits.yaml", "stripes_cnn.yaml"):
        assert "class_path: torchmetrics." in (ROOT / "examples" / config).read_text(), config


def test_py_typed_marker_ships() -> None:
    assert (ROOT / "ort_lightning" / "py.typed").is_file()


@pytest.mark.slow  # a child process
def test_import_without_onnxruntime_names_both_install_commands() -> None:
    code = "import sys; sys.modules['onnxruntime'] = None; import ort_lightning"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert 'pip install "ort-lightning[cpu]"' in result.stderr
    assert 'pip install "ort-lightning[cuda]"' in result.stderr


def test_public_names() -> None:
    import ort_lightning
    from ort_lightning.artifacts import TrainingArtifacts
    from ort_lightning.callbacks import ORTCheckpoint
    from ort_lightning.export import export_artifacts
    from ort_lightning.strategies import ORTDDPStrategy
    from ort_lightning.training import ORTLightningModule, ORTOptimizer, save_pretrained

    public = [ORTCheckpoint, ORTDDPStrategy, ORTLightningModule, ORTOptimizer, TrainingArtifacts, export_artifacts,
              save_pretrained]
    assert ort_lightning.__all__ == sorted(["__version__", *(thing.__name__ for thing in public)])
    assert all(getattr(ort_lightning, thing.__name__) is thing for thing in public)  # imported on first use
    with pytest.raises(AttributeError, match="no attribute 'ORTModule'"):
        ort_lightning.ORTModule  # noqa: B018


def test_fleet_public_names() -> None:
    pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]"')
    import ort_lightning.fleet as fleet
    from ort_lightning.fleet.config.fleet_config import FleetConfig
    from ort_lightning.fleet.devices.client import DeviceClient
    from ort_lightning.fleet.devices.protocol import ClientData
    from ort_lightning.fleet.devices.state_values import get_values, set_values
    from ort_lightning.fleet.devices.trainer_loop import evaluate_module
    from ort_lightning.fleet.devices.weight_order import WeightOrder
    from ort_lightning.fleet.engines.browser import BrowserDevice, BrowserFleet, BrowserGrid, Refusal
    from ort_lightning.fleet.engines.local import LocalGrid, run_local
    from ort_lightning.fleet.run import run_fleet
    from ort_lightning.fleet.server.global_model import CheckpointEachRound, GlobalModel, round_path
    from ort_lightning.fleet.server.secure import SecureFleetServer, secure_mods
    from ort_lightning.fleet.server.server_app import FleetServer, RoundRecord
    from ort_lightning.fleet.server.strategies import strategy_from

    public = [BrowserDevice, BrowserFleet, BrowserGrid, CheckpointEachRound, ClientData, DeviceClient, FleetConfig,
              FleetServer,
              GlobalModel, LocalGrid, Refusal, RoundRecord, SecureFleetServer, WeightOrder, evaluate_module,
              get_values, round_path, run_fleet, run_local, secure_mods, set_values, strategy_from]
    assert fleet.__all__ == sorted(thing.__name__ for thing in public)
    assert all(getattr(fleet, thing.__name__) is thing for thing in public)  # imported on first use
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        fleet.Trainer  # noqa: B018


@pytest.mark.slow  # a child process
def test_inspect_and_its_one_line_error_do_not_import_lightning(tmp_path: Path) -> None:
    code = ("import sys; from ort_lightning.cli import main; status = main(['inspect', sys.argv[1]]); "
            "print(status, 'lightning' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "missing")], capture_output=True, text=True,
                            check=True)
    assert result.stdout.split() == ["2", "False"]
    assert result.stderr.strip().splitlines()[-1].startswith("ort-lightning: error: ")


@pytest.mark.slow  # a child process
def test_import_leaves_the_root_logger_as_it_was() -> None:
    # onnxruntime's import calls logging.basicConfig(level=INFO); Lightning's INFO lines would print twice.
    code = "import logging, ort_lightning; root = logging.getLogger(); print(len(root.handlers), root.level)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["0", "30"]  # no handler, level WARNING as Python starts it
