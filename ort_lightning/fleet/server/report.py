"""What a fleet experiment leaves: the accuracy (or perplexity) per round printed, ``history.json`` and its plot."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ort_lightning.artifacts import TrainingArtifacts
from ort_lightning.fleet.config.fleet_config import FleetConfig
from ort_lightning.fleet.devices.device_files import device_files
from ort_lightning.fleet.devices.ort_loop import complete_start
from ort_lightning.fleet.server.secure import SecureFleetServer
from ort_lightning.fleet.server.server_app import FleetServer, RoundRecord

__all__ = ["report"]


def report(
    server: FleetServer | SecureFleetServer, config: FleetConfig, total: float, *, echo: bool = True, engine: str = "",
    departures: bool = True,
) -> dict[str, Any]:
    """Print the accuracy per round (when `echo`); write ``history.json`` and ``accuracy.png``; return the history.

    `engine` names where the rounds ran in the printed header (the config's engine when empty); `departures`
    False leaves out the devices that failed or left each round, for a run that printed them as they happened.
    """
    out = Path(config.output.folder)
    out.mkdir(parents=True, exist_ok=True)
    download = download_bytes(out / "device", config.devices.start)
    if echo:
        _print(server, config, total, engine or f"{config.engine.name} engine", departures)
        if download is not None:
            print(f"device folder:     {_size(download)} once per device (graphs and checkpoint)")
    payload = {**_history(server, config, total), "download_bytes": download}
    (out / "history.json").write_text(json.dumps(payload, indent=2), encoding="utf-8")
    plot = _plot(server, config, out) if config.output.plot else None
    if echo:
        print(f"round checkpoints: {out / 'rounds'}")
        print(f"history:           {out / 'history.json'}")
        if config.output.plot:
            print(f"plot:              {plot if plot else 'not written (pip install matplotlib)'}")
    return payload


def _title(config: FleetConfig) -> str:
    privacy = f", DP {config.privacy.side}-side" if config.privacy.side else ""
    secure = ", SecAgg+" if config.secagg.enabled else ""
    return f"{config.devices.count} devices, {config.data.partition} split, {config.strategy.name}{privacy}{secure}"


def _print(
    server: FleetServer | SecureFleetServer, config: FleetConfig, total: float, engine: str, departures: bool
) -> None:
    print(f"{_title(config)}, {engine}")
    if server.initial:
        print(f"round  0: {_score(server.initial)}  loss {server.initial['loss']:.4f}")
    for record in server.history:
        print(f"round {record.server_round:2d}: {_score(record.evaluation)}  "
              f"loss {record.evaluation.get('loss', float('nan')):.4f}  ({record.seconds:.2f} s; {record.devices} "
              f"devices, {_device_times(record.train_metrics)}, {record.aggregate_seconds * 1e3:.1f} ms aggregate, "
              f"{record.checkpoint_seconds * 1e3:.1f} ms checkpoint; {_traffic(record)})")
        if record.halted:
            print(f"          no aggregate: {record.halted}")
        if departures:
            for node, reason in sorted(record.failures.items()):
                print(f"          node {node} failed: {reason}")
            for node, reason in sorted(record.left.items()):
                print(f"          node {node} left: {reason}")
    print(f"total: {total:.1f} s")


def download_bytes(folder: Path, start: str) -> int | None:
    """The bytes of the device folder's files a device loads once (None where the run wrote no device folder)."""
    if not (folder / "ort_lightning.json").exists():
        return None
    artifacts = TrainingArtifacts.load(folder)
    files = device_files(artifacts, complete=complete_start(artifacts, start))
    return sum(path.stat().st_size for path in (files.training, files.optimizer, files.eval, files.checkpoint)
               if path is not None)


def _size(count: int) -> str:
    if count < 1000:
        return f"{count} bytes"
    return f"{count / 1e3:.1f} kB" if count < 10**6 else f"{count / 1e6:.1f} MB"


def _traffic(record: RoundRecord) -> str:
    return f"{_size(record.sent_bytes)} out and {_size(record.received_bytes)} back per device"


def _score(evaluation: dict[str, Any]) -> str:
    """A language model's perplexity where the evaluation has one, else the accuracy."""
    if "perplexity" in evaluation:
        return f"perplexity {evaluation['perplexity']:.3f}"
    return f"accuracy {evaluation.get('accuracy', float('nan')):.2%}"


def _device_times(metrics: dict[str, Any]) -> str:
    """A round's mean device timings: the local fit, the set-up before it, the loop's steps per second."""
    nan = float("nan")
    fit, setup = metrics.get("fit_seconds", nan), metrics.get("setup_seconds", nan)
    return (f"{fit * 1e3:.1f} ms mean local fit, {setup * 1e3:.2f} ms set-up, "
            f"{metrics.get('steps_per_second', nan):.0f} steps/s")


def _history(server: FleetServer | SecureFleetServer, config: FleetConfig, total: float) -> dict[str, Any]:
    rounds = [{"round": r.server_round, "seconds": r.seconds, "aggregate_seconds": r.aggregate_seconds,
               "checkpoint_seconds": r.checkpoint_seconds, "devices": r.devices, "examples": r.examples,
               "sent_bytes": r.sent_bytes, "received_bytes": r.received_bytes,
               "failures": {str(node): reason for node, reason in r.failures.items()},
               "left": {str(node): reason for node, reason in r.left.items()}, "halted": r.halted,
               **r.evaluation, "train": r.train_metrics,
               "checkpoint": None if r.checkpoint is None else str(r.checkpoint)} for r in server.history]
    return {"config": dataclasses.asdict(config), "initial": server.initial, "rounds": rounds, "seconds": total}


def _plot(server: FleetServer | SecureFleetServer, config: FleetConfig, out: Path) -> Path | None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    metric = "perplexity" if "perplexity" in server.initial else "accuracy"
    points = [(0, server.initial.get(metric))] + [(r.server_round, r.evaluation.get(metric)) for r in server.history]
    xs = [x for x, y in points if y is not None]
    ys = [y for _, y in points if y is not None]
    # NOTE: a Figure without pyplot: the caller's matplotlib backend (a notebook's inline one) stays as it was.
    figure = Figure(figsize=(5, 3.5))
    axes = figure.subplots()
    axes.plot(xs, ys, marker="o")
    axes.set(xlabel="round", ylabel=f"global {metric} (held-out data)", title=_title(config),
             **({"ylim": (0, 1)} if metric == "accuracy" else {}))
    axes.grid(alpha=0.3)
    figure.tight_layout()
    path = out / f"{metric}.png"
    figure.savefig(path, dpi=100)
    return path
