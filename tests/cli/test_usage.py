"""The console script's one-line usage errors, in-process (tests/cli/test_cli.py runs the script itself)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ort_lightning.cli.console import output_folder
from ort_lightning.cli.describe import describe, format_rows
from ort_lightning.cli.factory import export_factory, parse_shape
from ort_lightning.cli.lightning_cli import _check_accelerator, _check_precision, _check_strategy_name
from ort_lightning.cli.usage import OneLineParser, UsageError, one_line_argument_error
from tests.cli.mistakes import MISTAKES
from tests.helpers import ROOT, RunIf


@pytest.mark.parametrize("text", ["3x32x32", "", "3,-1", "a,b"], ids=["x-separated", "empty", "negative", "letters"])
def test_input_shape_must_be_comma_separated_positive_integers(text: str) -> None:
    pattern = rf"bad --input-shape '{re.escape(text)}': expected .* e\.g\. --input-shape 3,32,32"
    with pytest.raises(UsageError, match=pattern):
        parse_shape(text)


def test_a_shape_the_model_cannot_run_on_names_input_shape(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"stripes_cnn cannot run on inputs of shape \(batch, 64\) .*--input-shape"):
        export_factory("ort_lightning.demo:stripes_cnn", [(64,)], tmp_path / "art")
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "64-true", 16])
def test_precision_other_than_32_true_names_the_value_and_the_supported_one(precision: object) -> None:
    pattern = rf"--trainer\.precision {re.escape(repr(precision))} is not supported.*32-true"
    with pytest.raises(UsageError, match=pattern):
        _check_precision(precision)


@pytest.mark.parametrize("precision", [None, 32, "32", "32-true"])
def test_32_bit_precision_passes(precision: object) -> None:
    _check_precision(precision)


@pytest.mark.parametrize(
    ("strategy", "pattern"),
    [("ddp", r"'ddp' cannot train ORT graphs.*ort_ddp"), ("fsdp", r"'fsdp' cannot train ORT graphs"),
     ("ort_dpp", r"unknown --trainer\.strategy 'ort_dpp'; did you mean 'ort_ddp'\?")],
    ids=["ddp", "fsdp", "misspelled"],
)
def test_strategies_other_than_ort_ddp_are_refused_by_name(strategy: str, pattern: str) -> None:
    with pytest.raises(UsageError, match=pattern):
        _check_strategy_name(strategy)


@pytest.mark.parametrize("strategy", ["auto", "ort_ddp", "ort_ddp_spawn", "single_device"])
def test_single_process_and_ort_strategies_pass(strategy: str) -> None:
    _check_strategy_name(strategy)


@pytest.mark.parametrize(
    ("accelerator", "pattern"),
    [("tpu", r"'tpu' cannot run ORT graphs.* Valid values: auto, cpu, gpu, cuda"),
     ("mps", r"'mps' cannot run ORT graphs"),
     ("cpus", r"'cpus' cannot run ORT graphs; did you mean 'cpu'\?")],
    ids=["tpu", "mps", "misspelled"],
)
def test_accelerators_ort_cannot_use_are_refused(accelerator: str, pattern: str) -> None:
    with pytest.raises(UsageError, match=pattern):
        _check_accelerator(accelerator)


@RunIf(cuda=False)
def test_gpu_without_cuda_is_refused_before_training() -> None:
    with pytest.raises(UsageError, match=r"--trainer\.accelerator 'gpu', but torch sees no CUDA device"):
        _check_accelerator("gpu")


def test_argparse_errors_become_one_line_with_the_closest_choice() -> None:
    parser = OneLineParser(prog="tool")
    parser.add_subparsers(dest="command", required=True).add_parser("export")
    with pytest.raises(UsageError, match=r"invalid choice: 'exprt' .*; did you mean 'export'\?"):
        parser.parse_args(["exprt"])


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("Subcommand 'fit' does not accept option 'model.lrr'",
         "unknown key 'model.lrr'; did you mean 'model.lr'? Valid keys under 'model': model.artifacts, model.lr"),
        ("unrecognized arguments: --model.zzz 3", "unknown key 'model.zzz'. Valid keys under 'model': "
                                                  "model.artifacts, model.lr"),
        ('Parser key "model.lr":\n  Expected a <class \'float\'>. Got value: x',
         "bad value 'x' for model.lr: expected a float"),
        ('Parser key "config": File does not exist: \'/x/c.yaml\'',
         "config file '/x/c.yaml' does not exist; pass --config with the path of a YAML file, "
         "e.g. --config examples/digits.yaml"),
    ],
    ids=["unknown-key", "unrecognized", "wrong-type", "missing-config"],
)
def test_jsonargparse_messages_become_one_line(message: str, expected: str) -> None:
    assert one_line_argument_error(message, ["model.artifacts", "model.lr", "trainer.max_epochs"]) == expected


def test_an_out_folder_that_is_a_file_is_refused_and_the_file_kept(tmp_path: Path) -> None:
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    with pytest.raises(UsageError, match=r"--out '.*notes\.txt' is a file, but --out names the folder that receives "
                                         r"artifacts/; pass a folder that does not exist yet"):
        output_folder(mine, writes="artifacts/")
    assert mine.read_text() == "mine"
    assert output_folder(tmp_path / "new", writes="artifacts/") == tmp_path / "new"


def test_inspect_refuses_a_lightning_ckpt(tmp_path: Path) -> None:
    torch.save({"state_dict": {}}, tmp_path / "last.ckpt")
    with pytest.raises(UsageError, match=r"is a torch/Lightning checkpoint \(\.ckpt\); inspect reads an artifacts"):
        describe(tmp_path / "last.ckpt")


def test_inspect_rows_share_one_value_column() -> None:
    lines = format_rows([("a", "1"), ("global_step", "2"), ("lr", "3")]).splitlines()
    assert {line.index(value) for line, value in zip(lines, "123", strict=True)} == {len("global_step: ")}


def test_errors_catalog_names_only_cli_tests_that_exist() -> None:
    catalog = (ROOT / "docs" / "errors.md").read_text().split("## Command line")[1]
    cited = re.findall(r"tests/(cli/test_cli\w*\.py)::(\w+)(?:\[([\w-]+)\])?", catalog)
    assert cited, "docs/errors.md cites no test of tests/cli/"
    for file, name, case in cited:
        source = (ROOT / "tests" / file).read_text()
        assert f"def {name}(" in source, (file, name)
        if case:  # a parametrized case's id, in the test's file or in the mistakes it runs
            assert f'"{case}"' in source + (ROOT / "tests" / "cli" / "mistakes.py").read_text(), (file, case)
    # and every mistake the console script is tested with is in the catalog
    assert set(MISTAKES) <= {case for file, name, case in cited
                             if (file, name) == ("cli/test_cli_errors.py", "test_error_is_one_line_with_status_2")}
