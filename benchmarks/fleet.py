"""``python -m benchmarks.fleet``: an ort-lightning fleet beside Lightning and torch fleets, round by round.

The same model (the digits MLP, ``ort_lightning.demo.digits_mlp``), the same initial values,
the same partitions (`DigitsPartitions`, by default the 1,000-device ``writers`` split's way of
cutting), the same rounds, FedAvg with the same sampled fraction of devices, the same server
round loop (`FleetServer`: a checkpoint and a held-out evaluation after every round) and the
same Flower engine, in three fleets:

- ``ort``: devices run ONNX Runtime's device loop on the exported ORT artifacts, what a real device
  runs (ort-lightning's `DeviceClient`: ``.ort`` graphs, the nominal checkpoint plus the server's values).
- ``ort-lightning``: devices train the same artifacts under a ``lightning.Trainer``
  (``DeviceClient(runner="lightning")``, one module and one Trainer per worker).
- ``lightning``: devices train the torch module under a ``lightning.Trainer``, one module and
  one Trainer per worker as the ort fleet keeps them (`benchmarks._fleet_torch.LightningTorchClient`):
  ORT's share of the ort fleet's cost is the difference between these two.
- ``torch``: devices train the torch module with a plain Flower client written as Flower's
  quickstart-pytorch writes one (`benchmarks._fleet_torch.TorchClient`).

Each fleet runs in a fresh process (its device counts one after another, smallest first, the
peak memory counted anew for each), so that one fleet's memory does not count in the other's.
Per round it prints the wall time, the mean device set-up and training (the
device's own ``fit_seconds``; set-up is the rest of its ``train`` call, timed by a Flower mod),
FedAvg's aggregation, the round's checkpoint, the workers' peak resident memory and the global
accuracy; then, per fleet, the least-squares slope of each against the devices trained per
round.

Usage::

    python -m benchmarks.fleet                                   # 10, 100, 1,000 devices, 10 % each round
    python -m benchmarks.fleet --devices 10 100 --fraction 1.0   # every device every round
    python -m benchmarks.fleet --engine ray --plot fleet.png     # Flower's Ray engine; a PNG of the growth
    python -m benchmarks.fleet --devices 4 --fraction 1 --in-process   # a smoke run of seconds (the test's)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks._fleet_run import FLEETS, FleetRun, run_fleet

#: Columns of the per-round table: (header, key of RoundCosts, format).
COLUMNS = [
    ("fleet", "fleet", "{}"), ("devices", "population", "{}"), ("trained", "devices", "{}"), ("round", "round", "{}"),
    ("wall s", "wall_s", "{:.2f}"), ("setup ms", "setup_ms", "{:.1f}"), ("train ms", "train_ms", "{:.1f}"),
    ("aggregate ms", "aggregate_ms", "{:.1f}"), ("checkpoint ms", "checkpoint_ms", "{:.1f}"),
    ("peak RSS MB", "peak_rss_mb", "{:.0f}"), ("accuracy", "accuracy", "{:.2%}"),
]
#: Quantities whose growth with the device count is fitted.
GROWTH = ["wall_s", "setup_ms", "train_ms", "aggregate_ms", "checkpoint_ms", "peak_rss_mb"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[10, 100, 1000], help="population sizes")
    parser.add_argument("--rounds", type=int, default=1, help="federated rounds per fleet and size")
    parser.add_argument("--fraction", type=float, default=0.1, help="FedAvg's fraction_train (at least 2 devices)")
    parser.add_argument("--engine", choices=("local", "ray"), default="local",
                        help="local: Flower's apps in one process; ray: Flower's Ray simulation engine")
    parser.add_argument("--fleets", nargs="+", choices=FLEETS, default=list(FLEETS))
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per round")
    parser.add_argument("--lr", type=float, default=0.01, help="devices' AdamW learning rate")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--split", choices=("iid", "label", "writers"), default="writers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="keep artifacts, rounds and results here")
    parser.add_argument("--plot", type=Path, default=None, help="draw the growth with the device count to this PNG")
    parser.add_argument("--json", type=Path, default=None, help="write every round of every run to this JSON file")
    parser.add_argument("--artifacts", type=Path, default=None,
                        help="an exported digits MLP to reuse (default: exported into the output folder)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the fleets in this process (seconds faster; memory then not one fleet's alone)")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def _artifacts(folder: Path, seed: int) -> str:
    """The digits MLP's artifacts, with the nominal checkpoint the devices start from (as the fleet command)."""
    import torch

    from ort_lightning import export_artifacts
    from ort_lightning.demo import FEATURES, digits_mlp

    return str(export_artifacts(digits_mlp(seed=seed), torch.zeros(2, FEATURES), folder,
                                nominal_checkpoint=True, ort_format=True).directory)


def _in_child(runs: list[FleetRun], folder: Path) -> list[dict[str, Any]]:
    """Run one fleet's device counts in a fresh process; the results come back through ``result.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "runs.json"
    spec.write_text(json.dumps([asdict(run) for run in runs]), encoding="utf-8")
    subprocess.run([sys.executable, "-m", "benchmarks.fleet", "--child", str(spec)], check=True, timeout=3600,
                   stdout=subprocess.DEVNULL)
    return json.loads((folder / "result.json").read_text(encoding="utf-8"))


def _child(spec: Path) -> None:
    runs = [FleetRun(**run) for run in json.loads(spec.read_text(encoding="utf-8"))]
    (spec.parent / "result.json").write_text(json.dumps([run_fleet(run) for run in runs]), encoding="utf-8")


def _rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = [{"fleet": r["run"]["fleet"], "population": r["run"]["devices"], **row}
            for r in results for row in r["rounds"]]
    return sorted(rows, key=lambda row: (row["population"], row["round"], row["fleet"]))


def _table(rows: list[dict[str, Any]]) -> str:
    cells = [[header for header, _, _ in COLUMNS]]
    cells += [[fmt.format(row[key]) for _, key, fmt in COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True)) for line in cells)


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (NaN with fewer than two distinct xs)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / spread if spread else float("nan")


def growth(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per fleet: the slope of each `GROWTH` quantity per device trained in a round (rounds after the first
    when there are several: the first pays the workers' warm-up)."""
    slopes: dict[str, dict[str, float]] = {}
    for fleet in sorted({row["fleet"] for row in rows}):
        mine = [row for row in rows if row["fleet"] == fleet]
        later = [row for row in mine if row["round"] > 1] or mine
        xs = [float(row["devices"]) for row in later]
        slopes[fleet] = {key: _slope(xs, [float(row[key]) for row in later]) for key in GROWTH}
    return slopes


def _print_growth(slopes: dict[str, dict[str, float]]) -> None:
    print("\ngrowth per device trained in a round (least-squares slope over the device counts):")
    for fleet, values in slopes.items():
        print(f"  {fleet:13s}  wall {values['wall_s'] * 1e3:.2f} ms/device, setup {values['setup_ms']:+.3f} ms, "
              f"train {values['train_ms']:+.3f} ms, aggregate {values['aggregate_ms']:.3f} ms, "
              f"checkpoint {values['checkpoint_ms']:+.3f} ms, peak RSS {values['peak_rss_mb']:+.3f} MB per device")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 3.5))
    wall, memory = figure.subplots(1, 2)
    for fleet in sorted({row["fleet"] for row in rows}):
        mine = sorted((row for row in rows if row["fleet"] == fleet), key=lambda row: row["devices"])
        wall.plot([r["devices"] for r in mine], [r["wall_s"] for r in mine], marker="o", label=fleet)
        memory.plot([r["devices"] for r in mine], [r["peak_rss_mb"] for r in mine], marker="o", label=fleet)
    wall.set(xlabel="devices trained per round", ylabel="round wall time (s)", title="round time")
    memory.set(xlabel="devices trained per round", ylabel="workers' peak RSS (MB)", title="memory")
    for axes in (wall, memory):
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    """Run the fleets at every device count, print the rounds and the growth, write the plot and JSON."""
    args = _parser().parse_args(argv)
    if args.child is not None:
        _child(args.child)
        return
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as scratch:
        out = args.out or Path(scratch)
        artifacts = str(args.artifacts) if args.artifacts else _artifacts(out / "artifacts", args.seed)
        results = []
        for fleet in args.fleets:
            runs = [FleetRun(fleet=fleet, devices=devices, rounds=args.rounds, fraction=args.fraction,
                             engine=args.engine, artifacts=artifacts, out=str(out / f"{fleet}-{devices}"),
                             epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, split=args.split,
                             seed=args.seed) for devices in sorted(args.devices)]
            results += [run_fleet(run) for run in runs] if args.in_process else _in_child(runs, out / fleet)
    rows = _rows(results)
    print(f"{args.split} split, FedAvg fraction_train {args.fraction}, {args.epochs} local epoch(s), "
          f"{args.engine} engine; initial accuracy {results[0]['initial_accuracy']:.2%}")
    print(_table(rows))
    slopes = growth(rows)
    _print_growth(slopes)
    if args.plot is not None:
        _plot(rows, args.plot)
        print(f"plot: {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "growth": slopes}, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
