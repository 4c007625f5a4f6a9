"""``python -m benchmarks.node_fleet``: round times of a browser fleet against its device count, with Node devices.

A `BrowserFleet` on loopback serves the digits MLP (64 -> 16 -> 10, the web device folder at a
constant rate of 0.01); ``node_device.mjs --devices N`` joins N devices from one Node process (the
page's FleetDevice and runner.js, one onnxruntime-web module, one thread). Every device trains the
same amount in every run: one batch of about 28 digits per round (partition ``i`` of 50, whatever N
is), so that the round time shows what N devices cost the server and the one process that runs
them. FedAvg takes every device every round. Per device count it prints the time for the devices
to join (each opens its session once), round 1 (onnxruntime-web compiles its code in the first
sessions), the median of the later rounds and the load average; the device counts run one after
another in this process.

Usage::

    python -m benchmarks.node_fleet                       # 10, 25 and 50 devices, 6 rounds each
    python -m benchmarks.node_fleet --devices 10 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from flwr.serverapp.strategy import FedAvg

from ort_lightning import TrainingArtifacts, export_artifacts
from ort_lightning.demo import FEATURES, digits_mlp
from ort_lightning.export import prepare_for_web
from ort_lightning.fleet import BrowserFleet, FleetServer, GlobalModel
from ort_lightning.fleet.data.digits import DigitsPartitions
from ort_lightning.fleet.devices.protocol import ClientData
from ort_lightning.web import find_ort_web

NODE_DEVICE = Path(__file__).resolve().parents[1] / "ort_lightning" / "fleet" / "devices" / "web" / "node_device.mjs"
#: Every device trains partition i of this many, whatever the fleet's size: the same work per device.
SHARES = 50
DATA = DigitsPartitions(batch_size=32, seed=0)


def _share(partition: int, partitions: int) -> ClientData:
    return DATA(partition % SHARES, SHARES)


def _folders(root: Path) -> tuple[TrainingArtifacts, TrainingArtifacts]:
    exported = export_artifacts(digits_mlp(16, seed=0), torch.zeros(2, FEATURES), root / "exported",
                                nominal_checkpoint=True, ort_format=True, verify=False)
    return exported, prepare_for_web(exported, root / "web", lr=0.01)


def run(devices: int, rounds: int, folders: tuple[TrainingArtifacts, TrainingArtifacts], ort: str,
        root: Path) -> dict[str, float]:
    """One fleet of `devices` Node devices for `rounds` rounds; its join, first-round and later-round seconds."""
    exported, web = folders
    node = shutil.which("node")
    if node is None:
        raise SystemExit("node is not installed; this benchmark runs Node devices")
    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=devices, min_train_nodes=devices)
    server = FleetServer(GlobalModel(exported), strategy, rounds=rounds, directory=root / f"rounds-{devices}")
    with BrowserFleet(web, _share, port=0, devices=devices, device_timeout=120, ort_web=ort) as fleet:
        started = time.perf_counter()
        process = subprocess.Popen([node, "--experimental-websocket", str(NODE_DEVICE), fleet.url, "--ort-web", ort,
                                    "--devices", str(devices)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            if not fleet.wait_for_devices(300):
                raise SystemExit(f"{len(fleet.connected)} of {devices} Node devices joined within 300 s")
            joined = time.perf_counter() - started
            fleet.run(server)
        finally:
            fleet.close()
            process.wait(timeout=60)
    seconds = [record.seconds for record in server.history]
    later = statistics.median(seconds[1:]) if rounds > 1 else float("nan")
    return {"join": joined, "first": seconds[0], "later": later}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[10, 25, 50])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--ort-web", default=None, help="onnxruntime-web's dist/ folder (found by default)")
    args = parser.parse_args(argv)
    ort = find_ort_web(args.ort_web or str(Path(__file__).resolve().parents[1] / "node_modules" / "onnxruntime-web"
                                          / "dist"))
    with tempfile.TemporaryDirectory(prefix="ort-lightning-node-fleet-") as temporary:
        root = Path(temporary)
        folders = _folders(root)
        print("| devices | all joined (s) | round 1 (s) | later rounds, median (s) | per device (ms) | load average |")
        print("|---|---|---|---|---|---|")
        for devices in args.devices:
            result = run(devices, args.rounds, folders, ort, root)
            load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
            print(f"| {devices} | {result['join']:.2f} | {result['first']:.2f} | {result['later']:.2f} | "
                  f"{1000 * result['later'] / devices:.1f} | {load} |", flush=True)


if __name__ == "__main__":
    main()
