"""Every mistake a user can make on the console script's command line, with the one error line each must print."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import torch

from tests.cli.script import CONFIG


@dataclass(frozen=True)
class Mistake:
    """A command with one mistake, the files it needs in its folder, and the one error line it must print."""

    args: tuple[str, ...]
    pattern: str
    files: dict[str, bytes] = field(default_factory=dict)


def _torch_ckpt() -> bytes:
    buffer = io.BytesIO()
    torch.save({"state_dict": {"w": torch.zeros(2)}}, buffer)
    return buffer.getvalue()


def _fit(*args: str) -> tuple[str, ...]:
    return ("fit", "--config", str(CONFIG), *args)


FACTORY = ("export", "ort_lightning.demo:digits_mlp", "--out", "x")
MISTAKES = {
    # export / inspect / the subcommand itself (argparse)
    "bad-source": Mistake(("export", "no_colon_here", "--out", "x"), r"package\.module:factory"),
    "no-factory": Mistake(("export", "ort_lightning.demo:nothing", "--out", "x", "--input-shape", "64"),
                          r"no callable 'nothing'"),
    "no-shape": Mistake(FACTORY, r"needs --input-shape"),
    "bad-loss": Mistake((*FACTORY, "--input-shape", "64", "--loss", "hinge"),
                        r"ExportError: Expected `loss` to be one of"),
    "bad-frozen": Mistake((*FACTORY, "--input-shape", "64", "--frozen", "nope"), r"Cannot freeze \['nope'\]"),
    "shape-with-x": Mistake((*FACTORY, "--input-shape", "3x32x32"),
                            r"bad --input-shape '3x32x32'.*e\.g\. --input-shape 3,32,32"),
    "shape-for-cnn": Mistake(("export", "ort_lightning.demo:stripes_cnn", "--out", "x", "--input-shape", "64"),
                             r"cannot run on inputs of shape \(batch, 64\).*--input-shape"),
    "bad-optimizer-option": Mistake((*FACTORY, "--input-shape", "64", "--optimizer-option", "wd"),
                                    r"bad --optimizer-option 'wd': expected KEY=NUMBER"),
    "misspelled-option": Mistake((*FACTORY, "--input-shape", "64", "--frozn", "a"),
                                 r"unrecognized arguments: --frozn a; did you mean '--frozen'\?"),
    "misspelled-command": Mistake(("fitt",), r"invalid choice: 'fitt' \(choose from 'demo', 'export', 'inspect', "
                                             r"'save-pretrained', 'fleet', 'fit', 'validate', 'test', 'predict'\); "
                                             r"did you mean 'fit'\?"),
    "demo-out-file": Mistake(("demo", "--out", "notes.txt"), r"--out 'notes\.txt' is a file, but --out names the "
                             r"folder that receives artifacts/.*; pass a folder", {"notes.txt": b"mine"}),
    "export-out-file": Mistake((*FACTORY[:-1], "notes.txt", "--input-shape", "64"),
                               r"--out 'notes\.txt' is a file.*pass a folder", {"notes.txt": b"mine"}),
    "inspect-missing": Mistake(("inspect", "missing"), r"missing does not exist"),
    "inspect-junk": Mistake(("inspect", "junk"), r"junk is not an ONNX Runtime checkpoint; inspect reads",
                            {"junk": b"not a checkpoint"}),
    "inspect-lightning-ckpt": Mistake(("inspect", "last.ckpt"), r"last\.ckpt is a torch/Lightning checkpoint.*inspect "
                                      r"reads an artifacts folder.*ORT checkpoint file", {"last.ckpt": _torch_ckpt()}),
    # LightningCLI subcommands: caught after parsing, before any export, seed or process start
    "missing-artifacts": Mistake(_fit("--model.artifacts", "nothere", "--export.factory", "null"),
                                 r"model\.artifacts folder 'nothere' does not exist; add an export: section.*"
                                 r"ort-lightning export"),
    "misspelled-key": Mistake(_fit("--trainer.max_epocs", "3"),
                              r"unknown key 'trainer\.max_epocs'; did you mean 'trainer\.max_epochs'\?"),
    "misspelled-key-in-file": Mistake(("fit", "--config", "typo.yaml"),
                                      r"unknown key 'model\.lrr'; did you mean 'model\.lr'\? Valid keys under "
                                      r"'model': ",
                                      {"typo.yaml": CONFIG.read_bytes().replace(b"  lr: 0.01", b"  lrr: 0.01")}),
    "bad-value": Mistake(_fit("--model.lr", "fast"), r"bad value 'fast' for model\.lr: expected a float"),
    "misspelled-value": Mistake(_fit("--trainer.precision", "16-mixd"),
                                r"bad value '16-mixd' for trainer\.precision; did you mean '16-mixed'\? Valid values: "
                                r".*32-true"),
    "precision": Mistake(_fit("--trainer.precision", "16-mixed"),
                         r"--trainer\.precision '16-mixed' is not supported.*32-true"),
    "plain-ddp": Mistake(_fit("--trainer.strategy", "ddp", "--trainer.devices", "2"),
                         r"--trainer\.strategy 'ddp' cannot train ORT.*ort_ddp"),
    "misspelled-strategy": Mistake(_fit("--trainer.strategy", "ort_dpp"),
                                   r"unknown --trainer\.strategy 'ort_dpp'; did you mean 'ort_ddp'\?"),
    "misspelled-accelerator": Mistake(_fit("--trainer.accelerator", "cpus"),
                                      r"--trainer\.accelerator 'cpus' cannot run ORT graphs; did you mean 'cpu'\? "
                                      r"Valid values: auto, cpu, gpu"),
    "wrong-input-shape": Mistake(_fit("--export.input_shape", "[3, 32, 32]", "--model.artifacts", "fresh"),
                                 r"cannot run on inputs of shape \(batch, 3,32,32\).*export\.input_shape"),
    "bad-class-path": Mistake(_fit("--data", "foo.Bar"),
                              r"bad value 'foo\.Bar' for data: No module named 'foo'; name an importable class"),
    "no-last-checkpoint": Mistake(("validate", "--config", str(CONFIG), "--ckpt_path", "last"),
                                  r"--ckpt_path last found no last\.ckpt \(runs/digits/checkpoints\); run fit with "
                                  r"this config first"),
    "misspelled-ckpt-path": Mistake(("predict", "--config", str(CONFIG), "--ckpt_path", "lst"),
                                    r"--ckpt_path 'lst' is not a file; did you mean 'last'\?"),
    "no-config": Mistake(("fit",), r"required: fit\.model\.artifacts, fit\.data; pass --config cfg\.yaml"),
    "missing-config-file": Mistake(("validate", "--config", "nothere.yaml"),
                                   r"config file '.*nothere\.yaml' does not exist; pass --config"),
}
