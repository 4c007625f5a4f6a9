"""Every command of docs/cli.md (and so of the README), its output redirected, prints at most a screenful.

The commands are read from the page's ``bash`` blocks and run in order in one empty folder, through
the console script's `main` in this process (a child would pay Lightning's import for each of
thirteen commands); stdout is then a capture, not a terminal, as when a user redirects it to a file.
What a child would print on stderr is counted too: the warnings and Lightning's log records. Each
command gets a short run (1 epoch; 2 for the resume), and may add one line per epoch of its
documented run (at most 10): the count is checked for the documented epochs. tests/cli/test_cli.py runs
the README's ``demo`` as the installed script, 10 epochs, into pipes.
"""

from __future__ import annotations

import logging
import math
import re
import shlex
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ort_lightning.cli import main
from tests.cli.script import digits_labels, metric, torch_accuracy_of
from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # thirteen console-script runs, two exports with verification

SCREEN = 24
#: The most epochs a documented command trains (``demo --epochs 10``): each adds an epoch line.
DOCUMENTED_EPOCHS = 10
#: The longest line allowed (a progress bar's frames filled lines of 5,690 characters).
WIDEST = 300
CLI_PAGE = ROOT / "docs" / "cli.md"
README = ROOT / "README.md"
BASH = re.compile(r"^```bash\n(.*?)^```$", re.S | re.M)

MODELS = '''
import torch


def make_model() -> torch.nn.Module:
    """A tiny CNN for 3x32x32 images, 10 classes (docs/cli.md's mypkg.models:make_model)."""
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 5, stride=4), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 7 * 7, 10))
'''


def _llama_sources() -> None:
    """What docs/cli.md's save-pretrained commands read: a tiny Llama + LoRA exported to ``llama-lora`` and
    trained one step, with its ``checkpoints/last.ortckpt`` and Lightning's ``runs/llama/last.ckpt``."""
    peft = pytest.importorskip("peft")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from ort_lightning import ORTCheckpoint, ORTLightningModule, export_artifacts
    from tests.decoders import decoder, token_batch
    from tests.helpers import quiet_trainer

    model = peft.get_peft_model(decoder("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    batch = token_batch()
    module = ORTLightningModule(export_artifacts(model, batch, "llama-lora", loss=None, verify=False))
    callbacks = [ORTCheckpoint("checkpoints"), ModelCheckpoint("runs/llama", save_last=True)]
    quiet_trainer(max_steps=1, callbacks=callbacks).fit(module, DataLoader([batch], batch_size=None))


def commands(page: Path) -> list[str]:
    """The ``ort-lightning`` commands of `page`'s bash blocks, without comments or a ``.venv/bin/`` prefix."""
    found = []
    for block in BASH.findall(page.read_text(encoding="utf-8")):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0].removeprefix(".venv/bin/") == "ort-lightning":
                found.append(shlex.join(["ort-lightning", *words[1:]]))
    return found


@dataclass
class Printed:
    """What one command printed: stdout's lines, and what a child would have printed on stderr."""

    stdout: list[str]
    stderr: list[str]

    @property
    def lines(self) -> list[str]:
        return self.stdout + self.stderr


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += self.format(record).splitlines()


@pytest.fixture
def lightning_records() -> Iterator[_Records]:
    """Lightning's log records at INFO, as the console script prints them on stderr (the tests quiet them)."""
    records = _Records()
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    saved = [(logger.level, logger.handlers[:]) for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.handlers[:] = [records]
    yield records
    for logger, (level, handlers) in zip(loggers, saved, strict=True):
        logger.setLevel(level)
        logger.handlers[:] = handlers


def _short(command: list[str], resumed: bool) -> list[str]:
    """`command` with a short run: 1 epoch (2 for a resume, whose first epoch the first fit did)."""
    if command[0] == "demo":
        return [*command, "--epochs", "1"]
    if command[0] == "fit":
        return [*command, "--trainer.max_epochs", "2" if resumed else "1"]
    return command


def _filters_of_a_fresh_process() -> None:
    """Python's default warning filters, as the console script starts with them (pytest's own are gone)."""
    warnings.resetwarnings()
    warnings.simplefilter("default")
    for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")


def _run(command: list[str], capsys: pytest.CaptureFixture[str], records: _Records) -> Printed:
    records.lines.clear()
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        _filters_of_a_fresh_process()
        try:
            status = main(command)
        except SystemExit as exit:  # --help: argparse exits after printing
            status = int(exit.code or 0)
    out, err = capsys.readouterr()
    stderr = err.splitlines() + [f"{w.filename}:{w.lineno}: {w.message}" for w in caught] + records.lines
    assert status == 0, "\n".join(stderr[-20:])
    return Printed(out.splitlines(), stderr)


def test_readme_commands_are_those_of_the_cli_page() -> None:
    documented = {command.split()[1] for command in commands(CLI_PAGE)}
    readme = commands(README)
    assert readme, "the README shows no ort-lightning command"
    assert {command.split()[1] for command in readme} <= documented, readme


def test_each_documented_command_prints_at_most_a_screenful(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    lightning_records: _Records,
) -> None:
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main puts the current folder first
    for name in ("mypkg", "mypkg.models"):  # this test's package: gone with it
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    _llama_sources()
    documented = commands(CLI_PAGE)
    assert len(documented) >= 10, documented
    printed: dict[str, Printed] = {}
    for text in documented:
        command = shlex.split(text)[1:]
        command = [str(ROOT / part) if part.startswith("examples/") else part for part in command]
        resumed = "--ckpt_path" in command and command[0] == "fit"
        printed[text] = shown = _run(_short(command, resumed), capsys, lightning_records)
        trains = command[0] in ("demo", "fit")
        epochs = [line for line in shown.stdout if re.match(r"epoch \d+/\d+: ", line)]
        assert len(epochs) == int(trains), shown.stdout
        others = len(shown.lines) - len(epochs)
        allowed = SCREEN - (DOCUMENTED_EPOCHS if trains else 0)
        assert others <= allowed, f"{text} printed {others} lines (allowed {allowed}):\n" + "\n".join(shown.lines)
        assert all(len(line) <= WIDEST for line in shown.lines), text

    fits = [shown for text, shown in printed.items() if text.split()[1] in ("fit", "demo")]
    for shown in fits:  # one line says how the fit ended and where its checkpoints are
        [line] = [line for line in shown.stdout if line.startswith("fit: ")]
        assert re.search(r"val_loss [\d.]+", line), line
        assert re.search(r"last \S+\.(ckpt|ortckpt)", line), line
    resumed_line = next(line for line in fits[-1].stdout if line.startswith("fit: "))
    assert resumed_line.startswith("fit: 2 epochs, "), resumed_line  # the resume went on from the first fit's epoch
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()  # save-pretrained wrote peft's folders
    assert (tmp_path / "merged" / "config.json").is_file()
    [export] = printed[next(text for text in printed if "--out artifacts" in text)].stdout
    assert export.startswith("wrote "), export
    assert "parameters" in export, export
    digits: dict[str, Printed] = {}
    for text, shown in printed.items():
        if "digits.yaml" in text:
            digits.setdefault(text.split()[1], shown)  # the first fit, not its resume
    _check_digits_runs(digits, tmp_path)


def _check_digits_runs(printed: dict[str, Printed], folder: Path) -> None:
    """What the digits config's runs did: trained, then evaluated and predicted with the trained model."""
    fit, validate, test = ("\n".join(printed[name].lines) for name in ("fit", "validate", "test"))
    assert "exported ort_lightning.demo:digits_mlp to runs/digits/artifacts" in fit
    assert "LightningCLI's args parameter" not in fit
    val_loss = metric("val_loss", validate)
    assert val_loss < math.log(10) - 0.5  # untrained, the 10-class cross-entropy is about ln(10) = 2.30
    assert metric("test_loss", test) == pytest.approx(val_loss, abs=1e-6)  # the same held-out images and model
    # every logged metric is shown, not only the loss: the config's accuracy, as plain torch computes it
    accuracy = torch_accuracy_of(folder / "runs/digits/checkpoints/last.ckpt")
    assert metric("val_acc", validate) == pytest.approx(accuracy, abs=1e-6)
    assert metric("test_acc", test) == pytest.approx(accuracy, abs=1e-6)
    written = Path(re.search(r"written to (\S+)", "\n".join(printed["predict"].stdout)).group(1))  # type: ignore[union-attr]
    assert written == Path("runs/digits/predictions.pt")
    logits = torch.load(folder / written, weights_only=True)
    labels = digits_labels()
    assert logits.shape == (len(labels), 10)
    assert (logits.argmax(dim=1) == labels).float().mean() > 0.7
    # evaluation runs log nothing, and the resume logs into a version of its own
    assert sorted(p.name for p in (folder / "runs/digits/lightning_logs").iterdir()) == ["version_0", "version_1"]
