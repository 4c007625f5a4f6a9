"""A population of the size people use (1,000 non-IID devices of the digits), and the fleet benchmark.

The partition is checked by what it must be (disjoint, covering, deterministic) and its label skew
by a statistic whose IID value is closed-form; the benchmark's three fleets (ORT devices, Flower's
quickstart-style torch devices, the same under Lightning) against an independent float64 FedAvg
computed here by hand.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("sklearn")

from benchmarks.fleet import COLUMNS, main  # noqa: E402
from ort_lightning import export_artifacts  # noqa: E402
from ort_lightning.demo import FEATURES, digits_mlp  # noqa: E402
from ort_lightning.fleet.data.digits import DigitsPartitions, _splits, digits_test_loader, writer_groups  # noqa: E402
from ort_lightning.fleet.run import FleetConfig, run_experiment  # noqa: E402
from tests.helpers import ROOT

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "fleet_digits_1000.yaml"
DEVICES = 1000


@pytest.fixture(scope="module")
def digits_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("digits") / "artifacts"
    return export_artifacts(digits_mlp(), torch.zeros(2, FEATURES), folder, nominal_checkpoint=True).directory


def _labels(split: str, seed: int = 0) -> list[torch.Tensor]:
    parts = DigitsPartitions(split=split, seed=seed, shuffle=False)
    return [parts(i, DEVICES).train.dataset.tensors[1] for i in range(DEVICES)]  # type: ignore[attr-defined]


def _same_label_pairs(devices: list[torch.Tensor]) -> tuple[float, int]:
    """Share of the pairs of examples held by one device that have the same label, and the pair count."""
    same = pairs = 0
    for labels in devices:
        counts = torch.bincount(labels, minlength=10)
        same += int((counts * (counts - 1)).sum())
        pairs += len(labels) * (len(labels) - 1)
    return same / pairs, pairs // 2


def test_writers_split_gives_1000_disjoint_devices_covering_the_training_digits() -> None:
    parts = DigitsPartitions(split="writers", shuffle=False)
    x, _ = _splits(0)[0].tensors
    seen = torch.cat([parts(i, DEVICES).train.dataset.tensors[0] for i in range(DEVICES)])  # type: ignore[attr-defined]
    sizes = [len(parts(i, DEVICES).train.dataset) for i in range(DEVICES)]  # type: ignore[arg-type]
    assert min(sizes) >= 1
    assert sum(sizes) == len(x)
    # every training image exactly once: the devices' rows, counted, are the training split's
    for mine, theirs in zip(torch.unique(seen, dim=0, return_counts=True), torch.unique(x, dim=0, return_counts=True),
                            strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(writer_groups(0), writer_groups.__wrapped__(0))  # recomputed, not only cached
    again = DigitsPartitions(split="writers", shuffle=False)(417, DEVICES).train.dataset.tensors[1]  # type: ignore[attr-defined]
    assert torch.equal(again, parts(417, DEVICES).train.dataset.tensors[1])  # type: ignore[attr-defined]
    assert int(writer_groups(0).max()) + 1 == 13


def test_writers_split_is_label_skewed_where_an_iid_split_is_not() -> None:
    """Two examples of one device share a label with probability sum_k n_k (n_k - 1) / (N (N - 1)) under IID."""
    labels = _splits(0)[0].tensors[1]
    counts = torch.bincount(labels).double()
    iid_expected = float((counts * (counts - 1)).sum() / (len(labels) * (len(labels) - 1)))
    iid, pairs = _same_label_pairs(_labels("iid"))
    writers, _ = _same_label_pairs(_labels("writers"))
    sigma = math.sqrt(iid_expected * (1 - iid_expected) / pairs)
    assert abs(iid - iid_expected) < 3 * sigma
    assert writers > iid_expected + 4 * sigma, (writers, iid_expected, sigma)
    assert not torch.equal(writer_groups(0), writer_groups(1))


def test_the_1000_device_config_trains_only_the_sampled_fraction(digits_artifacts: Path, tmp_path: Path) -> None:
    config = FleetConfig.from_yaml(EXAMPLE, overrides=["rounds=1", "strategy.options={fraction_train: 0.005}",
                                                       f"output.folder={tmp_path}"])
    assert (config.devices.count, config.data.partition) == (DEVICES, "writers")
    data = DigitsPartitions(split=config.data.partition, batch_size=config.devices.batch_size, seed=config.seed)
    server = run_experiment(config, digits_artifacts, data, test=digits_test_loader(config.seed), echo=False)
    record = server.history[0]
    sizes = [len(DigitsPartitions(split="writers")(i, DEVICES).train.dataset) for i in range(DEVICES)]  # type: ignore[arg-type]
    assert record.devices == 5
    assert not record.failures
    assert 5 * min(sizes) <= record.examples <= 5 * max(sizes)


# ----------------------------------------------------------------------------- the benchmark
def _fedavg_by_hand(dtype: torch.dtype, devices: int, lr: float) -> dict[str, torch.Tensor]:
    """One FedAvg round of AdamW devices written out in plain torch, in `dtype` (the independent reference)."""
    parts = DigitsPartitions(split="writers", batch_size=16)  # the benchmark's batch size
    total: dict[str, torch.Tensor] = {}
    examples = 0
    for i in range(devices):
        net = digits_mlp().to(dtype)
        optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
        data = parts(i, devices).train
        for x, y in data:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(x.to(dtype)), y).backward()
            optimizer.step()
        n = len(data.dataset)  # type: ignore[arg-type]
        examples += n
        for name, value in net.state_dict().items():
            total[name] = total.get(name, 0) + value.double() * n
    return {name: value / examples for name, value in total.items()}


def _logit_bound(weights: dict[str, torch.Tensor], atol: float, x: torch.Tensor) -> torch.Tensor:
    """Per sample, how far the logits can move when every weight moves by at most `atol` (first order)."""
    hidden = torch.relu(x @ weights["0.weight"].T + weights["0.bias"])
    moved = atol * (x.abs().sum(1, keepdim=True) + 1)  # each hidden unit's pre-activation
    return (moved * weights["2.weight"].abs().sum(1)).max(1).values + atol * (hidden.abs().sum(1) + 1)


def test_fleet_benchmark_prints_every_column_and_both_fleets_agree(
    digits_artifacts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["--devices", "4", "--rounds", "1", "--fraction", "1.0", "--in-process", "--artifacts",
          str(digits_artifacts), "--out", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("fleet"))
    assert re.split(r"\s{2,}", header.strip()) == [name for name, _, _ in COLUMNS]
    rows = {line.split()[0]: line.split() for line in lines if re.match(r"\s*(ort|lightning|torch)\s+4\s", line)}
    assert set(rows) == {"ort", "lightning", "torch"}
    assert all(len(row) == len(COLUMNS) for row in rows.values())
    accuracy = {fleet: float(row[-1].rstrip("%")) / 100 for fleet, row in rows.items()}

    # NOTE: the tolerance is what float32 itself does to this round: the same AdamW devices in float32
    # and in float64 differ by d32; ORT sums in other orders than torch, with errors of the same size,
    # so each fleet must be within 4 * d32 of the float64 round (measured: ORT ~1.5 * d32).
    exact = _fedavg_by_hand(torch.float64, 4, 0.01)
    d32 = max(float((value - exact[name]).abs().max())
              for name, value in _fedavg_by_hand(torch.float32, 4, 0.01).items())
    assert 0 < d32 < 1e-4
    for fleet in ("ort", "lightning", "torch"):
        values = torch.load(tmp_path / f"{fleet}-4" / "final.pt")
        assert max(float((values[name].double() - exact[name]).abs().max()) for name in exact) <= 4 * d32, fleet

    # accuracy may differ only on held-out digits whose margin under the float64 round is within
    # reach of two such weight errors
    x, y = digits_test_loader(0).dataset.tensors  # type: ignore[attr-defined]
    x = x.double()
    logits = torch.relu(x @ exact["0.weight"].T + exact["0.bias"]) @ exact["2.weight"].T + exact["2.bias"]
    top = logits.topk(2, dim=1).values
    fragile = int((top[:, 0] - top[:, 1] <= 2 * _logit_bound(exact, 4 * d32, x)).sum())
    exact_accuracy = float((logits.argmax(1) == y).double().mean())
    for fleet, value in accuracy.items():
        assert abs(value - exact_accuracy) <= (fragile + 0.5) / len(y) + 5e-5, (fleet, value, exact_accuracy, fragile)
