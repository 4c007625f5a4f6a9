"""``python -m tests.fleet.devices.hundred_devices FOLDER``: 100 LoRA devices in one fresh process, its RSS after each.

A peft LoRA model over a 1.1 M-value base (4.5 MB) is exported into FOLDER, and one round of 100 devices
runs in this process with the server; a client mod reads the RSS after each device's reply (from
/proc: ``ru_maxrss`` is a peak). Prints the 100 values, in MiB, as one JSON line. A process of its
own, so that what other tests left in a worker's heap is not measured.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import peft
import torch
from flwr.app import Context, Message
from flwr.serverapp.strategy import FedAvg

from ort_lightning import export_artifacts
from ort_lightning.demo import FEATURES
from ort_lightning.export import prepare_for_web
from ort_lightning.fleet import DeviceClient, FleetServer, GlobalModel, run_local
from ort_lightning.fleet.data.digits import DigitsPartitions

DEVICES = 100


def _rss_mb() -> float:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def main(folder: Path) -> list[float]:
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(FEATURES, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["2"]))
    exported = export_artifacts(model, torch.zeros(2, FEATURES), folder / "exported", nominal_checkpoint=True,
                                ort_format=True, verify=False)
    device = prepare_for_web(exported, folder / "device", lr=0.02)
    rss: list[float] = []

    def measure(message: Message, context: Context, call_next: Any) -> Message:
        reply: Message = call_next(message, context)
        rss.append(_rss_mb())
        return reply

    strategy = FedAvg(fraction_evaluate=0.0, min_available_nodes=DEVICES, min_train_nodes=DEVICES)
    server = FleetServer(GlobalModel(exported), strategy, rounds=1, directory=folder / "rounds")
    client = DeviceClient(device.directory, DigitsPartitions(batch_size=16, seed=0))
    run_local(server.server_app(), client.client_app(mods=[measure]), nodes=DEVICES)
    return rss


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
