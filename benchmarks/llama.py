"""``python -m benchmarks.llama``: a Llama at a real size, exported and trained, time and peak memory per process.

The model is transformers' ``LlamaForCausalLM`` built from its config with random weights (no
download): by default the shape of SmolLM-135M (hidden 576, 30 layers, 9 query and 3 key/value
heads, intermediate 1536, vocabulary 49,152, tied embeddings), with a peft LoRA adapter (r=8 on
``q_proj`` and ``v_proj``) or as a full fine-tune; ``--size 1b`` is a Llama of about 1B
parameters (hidden 2048, 16 layers, 32 query and 8 key/value heads, intermediate 8192,
vocabulary 32,000: 4.1 GB of float32 weights). Batches are ``input_ids`` and ``labels`` (the
model's own causal-LM loss), batch 4 x 128 tokens.

Each measured step runs in a process of its own, so that its peak resident memory
(``getrusage``'s ``ru_maxrss``) is its own:

- **export**: ``export_artifacts`` with verification; the peak of the exporting process, of the
  child that computes the torch reference (forked from it) and of the ONNX Runtime child;
- **train**: Lightning + ORT (``ORTLightningModule`` on the folder) and Lightning + torch (+ peft)
  (a ``LightningModule`` around the same model, torch's AdamW on the trainable parameters), each
  ``--warmup`` steps then ``--steps`` timed steps, in turns over ``--rounds`` rounds, so that the
  two step times come from one run; the median interval between batch ends, and each process's
  peak.

Usage::

    python -m benchmarks.llama                          # 135M shape, LoRA r=8 (about 10 minutes, ~3 GB)
    python -m benchmarks.llama --full                   # the same as a full fine-tune
    python -m benchmarks.llama --size 1b --rounds 1 --warmup 0 --steps 3 --runners ort   # ~1B with LoRA
    python -m benchmarks.llama --quick                  # a tiny Llama: seconds, no usable numbers
    python -m benchmarks.llama --quick --rounds 0       # the same, export only (what the tests run)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: Llama configs by size: keyword arguments of ``transformers.LlamaConfig``.
SIZES: dict[str, dict[str, Any]] = {
    "135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
             "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True,
             "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
    "1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "intermediate_size": 8192, "vocab_size": 32000, "tie_word_embeddings": True,
           "max_position_embeddings": 2048},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 100, "tie_word_embeddings": True},
}
LR = 1e-4
SEQUENCE = 128
BATCH = 4


def _peak_gib(who: int = resource.RUSAGE_SELF) -> float:
    """Peak resident set size of this process (or of its largest waited-for child), in GiB (Linux: KiB)."""
    return resource.getrusage(who).ru_maxrss / 2**20


def build(size: str, *, lora: bool, attention: str) -> Any:
    """The Llama of `size` (seed 0), with its LoRA adapter (seed 0) unless a full fine-tune."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], attn_implementation=attention)
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    return model


def batches(size: str, count: int, *, sequence: int = SEQUENCE, batch: int = BATCH) -> list[dict[str, Any]]:
    """`count` batches of random token ids (seed 1), each its own labels."""
    import torch

    generator = torch.Generator().manual_seed(1)
    vocabulary = SIZES[size]["vocab_size"]
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocabulary, (batch, sequence), generator=generator)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def _watch_children() -> dict[str, float]:
    """Record the peak RSS of each of the exporter's two children, by name, as they end (``os.wait4``).

    NOTE: measurement only: the verification's own waits (``os.waitpid`` of the forked reference
    child, ``subprocess.run`` of the ORT child) are replaced by ones that read the child's rusage.
    """
    import types

    from ort_lightning.export.verify import forked, job

    peaks: dict[str, float] = {}

    def waitpid(pid: int, options: int) -> tuple[int, int]:
        done, status, usage = os.wait4(pid, options)
        peaks["reference child"] = usage.ru_maxrss / 2**20
        return done, status

    def run(command: list[str], *, timeout: float | None = None, **_: Any) -> subprocess.CompletedProcess[str]:
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            process = subprocess.Popen(command, stdout=out, stderr=err, text=True)
            _, status, usage = os.wait4(process.pid, 0)
            peaks["ORT child"] = usage.ru_maxrss / 2**20
            out.seek(0)
            err.seek(0)
            code = os.waitstatus_to_exitcode(status)
            return subprocess.CompletedProcess(command, code, out.read(), err.read())

    forked.os = types.SimpleNamespace(**{**vars(os), "waitpid": waitpid})  # type: ignore[assignment]
    job.subprocess = types.SimpleNamespace(**{**vars(subprocess), "run": run})  # type: ignore[assignment]
    return peaks


def child_export(
    size: str, folder: Path, *, lora: bool, attention: str, external: str, sequence: int
) -> dict[str, Any]:
    """Build and export with verification; the time, the folder and the peaks of each process."""
    from ort_lightning import export_artifacts

    peaks = _watch_children()
    model = build(size, lora=lora, attention=attention)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    example = batches(size, 1, sequence=sequence, batch=2)[0]
    built = _peak_gib()
    started = time.perf_counter()
    artifacts = export_artifacts(
        model, example, folder, loss=None, external_data={"auto": None, "on": True, "off": False}[external]
    )
    seconds = time.perf_counter() - started
    report = artifacts.manifest.verification or {}
    return {
        "weights_bytes": weights,
        "trainable": trainable,
        "seconds": seconds,
        "folder_bytes": _folder_bytes(folder),
        "peak_after_build_gib": built,
        "peak_gib": _peak_gib(),
        "children_gib": peaks,
        "verification": {key: report.get(key) for key in ("status", "seconds", "reason", "margin")},
    }


def _fit(module: Any, loader: Any, steps: int) -> list[float]:
    """`steps` steps under a quiet Trainer; the intervals between batch ends, in seconds."""
    import lightning.pytorch as pl

    stamps: list[float] = []

    class _Clock(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            stamps.append(time.perf_counter())

    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[_Clock()],
    )
    trainer.fit(module, loader)
    return [later - earlier for earlier, later in zip(stamps, stamps[1:], strict=False)]


def _torch_module(size: str, *, lora: bool, attention: str) -> Any:
    import lightning.pytorch as pl
    import torch

    class TorchLlama(pl.LightningModule):
        """What a user writes in plain Lightning: the (peft) model's own loss and AdamW on what trains."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build(size, lora=lora, attention=attention)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(**batch).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=LR)

    return TorchLlama()


def child_train(runner: str, size: str, folder: Path, *, lora: bool, attention: str, warmup: int,
                steps: int, sequence: int) -> dict[str, Any]:
    """`warmup` + `steps` + 1 steps of one runner; the timed intervals and this process's peak."""
    from torch.utils.data import DataLoader

    from ort_lightning import ORTLightningModule

    data = batches(size, warmup + steps + 1, sequence=sequence)
    loader = DataLoader(data, batch_size=None, shuffle=False)  # each item is already a batch
    if runner == "ort":
        module = ORTLightningModule(str(folder), lr=LR, lr_scheduler="constant")
    else:
        module = _torch_module(size, lora=lora, attention=attention)
    intervals = _fit(module, loader, warmup + steps + 1)
    return {"intervals": intervals[warmup:], "peak_gib": _peak_gib()}


def _run_child(arguments: list[str]) -> dict[str, Any]:
    """Run this module with `arguments` in a fresh interpreter; its JSON result."""
    command = [sys.executable, "-m", "benchmarks.llama", *arguments]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env={**os.environ})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(arguments)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _common(args: argparse.Namespace) -> list[str]:
    return ["--size", args.size, "--attention", args.attention, "--sequence", str(args.sequence),
            *(["--full"] if args.full else [])]


def orchestrate(args: argparse.Namespace) -> list[str]:
    """Export once, then train both runners in turns; the Markdown lines of the report."""
    with tempfile.TemporaryDirectory(prefix="ort-lightning-llama-") as tmp:
        folder = Path(tmp) / "artifacts"
        exported = _run_child(["--child", "export", str(folder), *_common(args), "--external-data", args.external_data])
        print(json.dumps(exported), flush=True)
        times: dict[str, list[float]] = {"ort": [], "torch": []}
        peaks: dict[str, float] = {"ort": 0.0, "torch": 0.0}
        for round_index in range(args.rounds):
            order = [runner for runner in ("ort", "torch") if runner in args.runners]
            for runner in order if round_index % 2 == 0 else order[::-1]:
                trained = _run_child(["--child", runner, str(folder), *_common(args), "--warmup", str(args.warmup),
                                      "--steps", str(args.steps)])
                print(runner, json.dumps(trained), flush=True)
                times[runner] += trained["intervals"]
                peaks[runner] = max(peaks[runner], trained["peak_gib"])
    return _report(args, exported, times, peaks)


def _report(args: argparse.Namespace, exported: dict[str, Any], times: dict[str, list[float]],
            peaks: dict[str, float]) -> list[str]:
    weights = exported["weights_bytes"]
    children = exported["children_gib"]
    kind = "full fine-tune" if args.full else "LoRA r=8 on q_proj, v_proj"
    ratio = exported["peak_gib"] * 2**30 / weights
    lines = [
        f"{args.size} Llama, {kind}, attention {args.attention}: {weights / 1e6:.0f} MB of weights, "
        f"{exported['trainable']:,} trainable parameters",
        "",
        "| export (verified) | seconds | artifact folder | peak RSS, exporting process | x weights | "
        "peak RSS, reference child | peak RSS, ORT child |",
        "|---|---|---|---|---|---|---|",
        f"| `export_artifacts` ({exported['verification']['status']}, verification "
        f"{exported['verification']['seconds']} s) | {exported['seconds']:.1f} | "
        f"{exported['folder_bytes'] / 1e6:.0f} MB | "
        f"{exported['peak_gib']:.2f} GiB | {ratio:.1f}x | {_gib(children.get('reference child'))} | "
        f"{_gib(children.get('ORT child'))} |",
        "",
        f"| training (batch {BATCH} x {args.sequence}, AdamW) | median ms/step | steps timed | peak RSS |",
        "|---|---|---|---|",
    ]
    torch_label = "Lightning + torch" + ("" if args.full else " + peft")
    for runner, label in (("ort", "Lightning + ORT"), ("torch", torch_label)):
        if times[runner]:
            median = statistics.median(times[runner]) * 1e3
            lines.append(f"| {label} | {median:,.0f} | {len(times[runner])} | {peaks[runner]:.2f} GiB |")
    if times["ort"] and times["torch"]:
        lines.append("")
        speed = statistics.median(times["ort"]) / statistics.median(times["torch"])
        lines.append(f"L+ORT / L+torch step time: {speed:.2f}; training memory ORT / torch: "
                     f"{peaks['ort'] / peaks['torch']:.2f}")
    return lines


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} GiB"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llama", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="135m")
    parser.add_argument("--full", action="store_true", help="a full fine-tune instead of LoRA r=8")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                        help="transformers' attention implementation (sdpa: its default)")
    parser.add_argument("--external-data", choices=("auto", "on", "off"), default="auto",
                        help="export_artifacts(external_data=None/True/False)")
    parser.add_argument("--sequence", type=int, default=SEQUENCE, help="tokens per row of the export's example")
    parser.add_argument("--rounds", type=int, default=None,
                        help="training runs of each runner, in turns (default 2, --quick 1; 0: export only)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per training run")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per training run")
    parser.add_argument("--runners", nargs="+", choices=("ort", "torch"), default=["ort", "torch"],
                        help="which training runs (Lightning + ORT, Lightning + torch)")
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, one round of 2 steps: a smoke run")
    parser.add_argument("--child", nargs=2, metavar=("WHAT", "FOLDER"), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
            logging.getLogger(name).setLevel(logging.ERROR)
        what, folder = args.child[0], Path(args.child[1])
        if what == "export":
            result = child_export(args.size, folder, lora=not args.full, attention=args.attention,
                                  external=args.external_data, sequence=args.sequence)
        else:
            result = child_train(what, args.size, folder, lora=not args.full, attention=args.attention,
                                 warmup=args.warmup, steps=args.steps, sequence=args.sequence)
        print(json.dumps(result))
        return 0
    if args.quick:
        args.size, args.warmup, args.steps, args.sequence = "tiny", 1, 2, 16
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    started = time.perf_counter()
    lines = orchestrate(args)
    print(f"total: {time.perf_counter() - started:.0f} s")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
