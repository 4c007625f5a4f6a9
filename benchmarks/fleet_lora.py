"""``python -m benchmarks.fleet_lora``: a federated LoRA round when only the adapters travel, against the whole state.

The model is transformers' Llama from its config with random weights (no download) with peft LoRA
(r=8 on ``q_proj`` and ``v_proj``): ``--size 135m`` is SmolLM-135M's shape (``benchmarks.llama``),
``example`` the federated fine-tune example's (hidden 256, 4 layers, vocabulary 512), ``tiny`` a
check that runs in seconds. It is exported once (the model's own loss, no verification) and
prepared for devices at a constant rate. Each device trains ``--batches`` batches of 2 x 64 random
tokens per round. Every measurement runs in a process of its own, so that its peak RSS is its own:

- **in-process**: ``--devices`` simulated devices (ONNX Runtime's device loop) in one process with
  the server, ``--rounds`` rounds of FedAvg; the bytes of Flower's arrays each device is sent and
  sends back (recorded by a client mod, not by the fleet's own count), the median round time, the
  process's peak RSS;
- **node**: 2 Node devices (``node_device.mjs``, one process) in a browser fleet; the time until both
  joined (the folder downloaded and opened), the median round time, the Node process's peak RSS;
- **chromium**: one headless Chromium page; the time from its start until it joined.

``--baseline CHECKOUT`` runs the same children against the package of another checkout (the
release before federated LoRA sends every tensor both ways), so both rows come from one run.

Usage::

    python -m benchmarks.fleet_lora --size example
    python -m benchmarks.fleet_lora --size 135m --baseline ../ort-lightning-ebc2fd7 --devices 10 --rounds 2
    python -m benchmarks.fleet_lora --size tiny --runs in-process       # seconds, no usable numbers
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

LLAMAS: dict[str, dict[str, Any]] = {
    "example": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 1536, "vocab_size": 512},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 128, "vocab_size": 100},
}
LR = 1e-4
SEQUENCE, BATCH = 64, 2
RUNS = ("in-process", "node", "chromium")


def _config(size: str) -> dict[str, Any]:
    if size == "135m":
        from benchmarks.llama import SIZES

        return SIZES["135m"]
    return LLAMAS[size]


def _batches(size: str, count: int, seed: int) -> list[dict[str, Any]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, _config(size)["vocab_size"], (BATCH, SEQUENCE), generator=generator) for _ in range(count)]
    return [{"input_ids": batch, "labels": batch.clone()} for batch in ids]


def prepare(size: str, root: Path) -> dict[str, Any]:
    """Export the LoRA Llama and write its device folder; the sizes of what travels and what does not."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from ort_lightning import export_artifacts
    from ort_lightning.export import prepare_for_web

    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(**_config(size), use_cache=False)),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    started = time.perf_counter()
    exported = export_artifacts(model, _batches(size, 1, 0)[0], root / "exported", loss=None,
                                nominal_checkpoint=True, ort_format=True, verify=False)
    prepare_for_web(exported, root / "device", lr=LR)
    return {"export_seconds": time.perf_counter() - started,
            "trainable_bytes": 4 * sum(p.numel() for p in model.parameters() if p.requires_grad),
            "state_bytes": 4 * sum(t.numel() for t in [*model.parameters(), *model.buffers()])}


class _Data:
    """Each device's batches: `count` batches of random tokens, seeded by its partition (picklable)."""

    def __init__(self, size: str, count: int) -> None:
        self.size, self.count = size, count

    def __call__(self, partition: int, partitions: int) -> Any:
        from ort_lightning.fleet import ClientData

        return ClientData(train=_batches(self.size, self.count, 1 + partition))


def _bytes(message: Any) -> int:
    return sum(len(array.data) for record in message.content.array_records.values() for array in record.values())


def in_process(size: str, root: Path, devices: int, rounds: int, batches: int) -> dict[str, Any]:
    """`devices` simulated devices and the server in this process."""
    from flwr.serverapp.strategy import FedAvg

    from ort_lightning.fleet import DeviceClient, FleetServer, GlobalModel, run_local

    traffic: list[tuple[int, int]] = []

    def record(message: Any, context: Any, call_next: Any) -> Any:
        reply = call_next(message, context)
        traffic.append((_bytes(message), _bytes(reply)))
        return reply

    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=devices, min_train_nodes=devices)
    server = FleetServer(GlobalModel(root / "exported"), strategy, rounds=rounds, directory=root / "rounds-local")
    client = DeviceClient(root / "device", _Data(size, batches))
    run_local(server.server_app(), client.client_app(mods=[record]), nodes=devices)
    seconds = [r.seconds for r in server.history]
    return {"sent": max(s for s, _ in traffic), "received": max(r for _, r in traffic),
            "round_seconds": statistics.median(seconds[1:] or seconds),
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _peak_of(pid: int, peak: list[float], done: threading.Event) -> None:
    """Poll a process's VmHWM (its peak RSS so far) until `done`."""
    while not done.wait(0.2):
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return
        kib = next((int(line.split()[1]) for line in text.splitlines() if line.startswith("VmHWM:")), 0)
        peak[0] = max(peak[0], kib / 2**20)  # (a process that ended has no VmHWM)


def _fleet(size: str, root: Path, devices: int, batches: int, ort: str) -> Any:
    from ort_lightning.fleet import BrowserFleet

    return BrowserFleet(root / "device", _Data(size, batches), port=0, devices=devices, device_timeout=1800,
                        ort_web=ort, wait_timeout=1800)


def node(size: str, root: Path, rounds: int, batches: int, ort: str) -> dict[str, Any]:
    """2 Node devices in one Node process."""
    from flwr.serverapp.strategy import FedAvg

    import ort_lightning
    from ort_lightning.fleet import FleetServer, GlobalModel

    script = Path(ort_lightning.__file__).parent / "fleet" / "devices" / "web" / "node_device.mjs"
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2)
    server = FleetServer(GlobalModel(root / "exported"), strategy, rounds=rounds, directory=root / "rounds-node")
    peak, done = [0.0], threading.Event()
    with _fleet(size, root, 2, batches, ort) as fleet:
        started = time.perf_counter()
        process = subprocess.Popen([shutil.which("node") or "node", "--max-old-space-size=8192",
                                    "--experimental-websocket", str(script), fleet.url, "--ort-web", ort, "--devices",
                                    "2"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        watch = threading.Thread(target=_peak_of, args=(process.pid, peak, done), daemon=True)
        watch.start()
        try:
            if not fleet.wait_for_devices(1800):
                raise SystemExit(f"{len(fleet.connected)} of 2 Node devices joined")
            joined = time.perf_counter() - started
            fleet.run(server)
        finally:
            fleet.close()
            done.set()
            process.wait(timeout=120)
    seconds = [r.seconds for r in server.history]
    return {"join_seconds": joined, "round_seconds": statistics.median(seconds[1:] or seconds), "peak_gib": peak[0]}


def chromium(size: str, root: Path, ort: str) -> dict[str, Any]:
    """One headless Chromium page: the seconds until it joined (the folder downloaded, the session opened)."""
    program = shutil.which("chromium") or shutil.which("chromium-browser")
    if program is None:
        raise SystemExit("Chromium is not installed")
    profile = tempfile.mkdtemp(prefix="ort-lightning-chromium-")
    with _fleet(size, root, 1, 1, ort) as fleet:
        started = time.perf_counter()
        page = subprocess.Popen([program, "--headless=new", "--no-sandbox", "--disable-gpu",
                                 f"--user-data-dir={profile}", fleet.url], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            joined = fleet.wait_for_devices(1800)
            seconds = time.perf_counter() - started
        finally:
            os.killpg(page.pid, 9)
            page.wait()
            shutil.rmtree(profile, ignore_errors=True)
    return {"join_seconds": seconds if joined else float("nan")}


def _child(args: argparse.Namespace) -> None:
    root = Path(args.root)
    if args.child == "prepare":
        result = prepare(args.size, root)
    elif args.child == "in-process":
        result = in_process(args.size, root, args.devices, args.rounds, args.batches)
    elif args.child == "node":
        result = node(args.size, root, args.rounds, args.batches, args.ort)
    else:
        result = chromium(args.size, root, args.ort)
    print(json.dumps(result), flush=True)


_RUN_PATH = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def _run(kind: str, args: argparse.Namespace, root: Path, checkout: Path | None) -> dict[str, Any]:
    """A child of this script over `checkout`'s package (this one's by default); its JSON line."""
    here = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (checkout or here, here))}
    # NOTE: run_path, not the script's path: Python would put benchmarks/ first on sys.path, where profile.py shadows
    # the standard library's (torch imports cProfile).
    command = [sys.executable, "-c", _RUN_PATH, str(Path(__file__).resolve()), "--child", kind, "--root",
               str(root), "--size", args.size, "--devices", str(args.devices), "--rounds", str(args.rounds),
               "--batches", str(args.batches), "--ort", args.ort]
    done = subprocess.run(command, env=env, cwd=checkout or here, capture_output=True, text=True, check=False)
    if done.returncode != 0:  # a row that says so: the other runs still measure
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        return {"failed": lines[-1][:160] if lines else f"exit status {done.returncode}"}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _size(count: float) -> str:
    return f"{count / 1e6:.2f} MB" if count >= 1e5 else f"{count / 1e3:.1f} kB"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["135m", *LLAMAS], default="example")
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout, to run the same children on")
    parser.add_argument("--ort", default=None, help="onnxruntime-web's dist/ folder (found by default)")
    parser.add_argument("--child", choices=["prepare", *RUNS], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return
    from ort_lightning.web import find_ort_web

    args.ort = find_ort_web(args.ort or str(Path(__file__).resolve().parents[1] / "node_modules" / "onnxruntime-web"
                                            / "dist"))
    checkouts = {"adapters only": None, **({"whole state (baseline)": args.baseline} if args.baseline else {})}
    with tempfile.TemporaryDirectory(prefix="ort-lightning-fleet-lora-") as temporary:
        root = Path(temporary)
        sizes = _run("prepare", args, root, None)
        print(f"{args.size}: LoRA adapters {_size(sizes['trainable_bytes'])} of {_size(sizes['state_bytes'])}; "
              f"export {sizes['export_seconds']:.1f} s; load average {os.getloadavg()[0]:.1f}")
        print("| exchange | run | sent / back per device round | round (s) | join (s) | peak RSS (GiB) |")
        print("|---|---|---|---|---|---|")
        for name, checkout in checkouts.items():
            for kind in args.runs:
                r = _run(kind, args, root, checkout)
                if "failed" in r:
                    print(f"| {name} | {kind} | failed: {r['failed']} | | | |", flush=True)
                    continue
                traffic = f"{_size(r['sent'])} / {_size(r['received'])}" if "sent" in r else ""
                print(f"| {name} | {kind} | {traffic} | {r.get('round_seconds', float('nan')):.2f} | "
                      f"{r.get('join_seconds', float('nan')):.2f} | {r.get('peak_gib', float('nan')):.2f} |",
                      flush=True)


if __name__ == "__main__":
    main()
