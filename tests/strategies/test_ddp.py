"""ORTDDPStrategy on real gloo process groups: 2 ranks of batch B against 1 process of batch 2B."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist

from ort_lightning import ORTDDPStrategy, ORTLightningModule
from ort_lightning.errors import ConfigurationError
from ort_lightning.strategies import thread_spinning
from ort_lightning.strategies.buckets import plan_buckets
from ort_lightning.training.session.parameters import parameter_views
from tests.conftest import Exported
from tests.helpers import ROOT, quiet_trainer
from tests.strategies import ddp_run

STEPS, BATCH = 20, 8


def _launch(*command: str) -> None:
    result = subprocess.run(list(command), cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-4000:]


def _run_ddp(artifacts: Exported, out: Path, **options: int) -> None:
    arguments = [f"--{name}={value}" for name, value in options.items()]
    _launch(sys.executable, "-m", "tests.strategies.ddp_run", str(artifacts.artifacts.directory), str(out), *arguments)


def _assert_equal_states(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor], atol: float) -> None:
    assert left.keys() == right.keys()
    for name in left:
        torch.testing.assert_close(left[name], right[name], rtol=0, atol=atol, msg=name)


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Any:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(mlp_adamw: Exported, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """20 AdamW steps on 2 gloo ranks of batch 8, started by Lightning's subprocess launcher."""
    out = tmp_path_factory.mktemp("ddp")
    _run_ddp(mlp_adamw, out, devices=2, batch=BATCH, steps=STEPS)
    return out


@pytest.mark.slow  # DDP ranks (the two_ranks fixture)
def test_two_ranks_match_one_process_with_the_double_batch(mlp_adamw: Exported, two_ranks: Path, tmp_path) -> None:
    reference = ddp_run.train(mlp_adamw.artifacts.directory, tmp_path, devices=1, batch=2 * BATCH, steps=STEPS)
    expected = {name: tensor.detach() for name, tensor in reference.state_dict().items()}
    ranks = ddp_run.load(two_ranks, 0)
    _assert_equal_states(ranks["state"], expected, atol=1e-5)
    assert ranks["world"] == 2
    # the training moved the parameters well beyond the tolerance
    initial = ORTLightningModule(mlp_adamw.artifacts).state_dict()
    assert max((initial[n] - expected[n]).abs().max().item() for n in expected) > 1e-2


@pytest.mark.slow
def test_both_ranks_hold_identical_parameters(two_ranks: Path) -> None:
    first, second = ddp_run.load(two_ranks, 0), ddp_run.load(two_ranks, 1)
    _assert_equal_states(first["state"], second["state"], atol=0)
    assert first["syncs"] == second["syncs"] == STEPS


def _resume(artifacts: Exported, checkpoint: Path, root: Path) -> ORTLightningModule:
    """Two more steps in one process on the double batch, from a Lightning checkpoint of STEPS steps."""
    module = ORTLightningModule(artifacts.artifacts, lr=0.01, lr_scheduler="constant")
    x, y = ddp_run.dataset("mlp", STEPS * 2 * BATCH)
    trainer = quiet_trainer(max_steps=STEPS + 2, use_distributed_sampler=False, default_root_dir=root)
    trainer.fit(module, datamodule=ddp_run.RankSlices(x, y, 2 * BATCH), ckpt_path=checkpoint)
    assert trainer.global_step == STEPS + 2
    return module


@pytest.mark.slow
def test_checkpoint_written_under_ddp_resumes_in_one_process(mlp_adamw: Exported, two_ranks: Path, tmp_path) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    module.load_state_dict(torch.load(two_ranks / "last.ckpt", weights_only=False)["state_dict"])
    at_checkpoint = ddp_run.load(two_ranks, 0)["state"]
    _assert_equal_states({n: t.detach() for n, t in module.state_dict().items()}, at_checkpoint, atol=0)
    resumed = _resume(mlp_adamw, two_ranks / "last.ckpt", tmp_path)
    # The reference: one process of the double batch, checkpointed after STEPS steps and resumed the same
    # way. NOTE: not an uninterrupted run of STEPS + 2: a Lightning checkpoint taken when max_steps ends
    # an epoch resumes at that epoch's batch index STEPS (one batch, then a new epoch), for torch
    # modules alike, so the two runs would see different batches.
    ddp_run.train(mlp_adamw.artifacts.directory, tmp_path / "one", devices=1, batch=2 * BATCH, steps=STEPS)
    reference = _resume(mlp_adamw, tmp_path / "one" / "last.ckpt", tmp_path)
    expected = {name: tensor.detach() for name, tensor in reference.state_dict().items()}
    _assert_equal_states({n: t.detach() for n, t in resumed.state_dict().items()}, expected, atol=1e-5)
    # the two resumed steps moved the parameters well beyond the tolerance, from ORT's restored moments
    assert max((at_checkpoint[n] - expected[n]).abs().max().item() for n in expected) > 1e-3


@pytest.mark.slow
def test_accumulation_under_torchrun_syncs_once_per_optimizer_step(mlp_adamw: Exported, tmp_path) -> None:
    steps, batch = 6, 4
    torchrun = Path(sys.executable).with_name("torchrun")
    _launch(str(torchrun), "--standalone", "--nproc-per-node=2", "-m", "tests.strategies.ddp_run",
            str(mlp_adamw.artifacts.directory), str(tmp_path / "ddp"), "--devices=2", f"--batch={batch}",
            f"--steps={steps}", "--accumulate=2")
    reference = ddp_run.train(mlp_adamw.artifacts.directory, tmp_path / "one", batch=2 * batch, steps=steps,
                              accumulate=2)
    ranks = [ddp_run.load(tmp_path / "ddp", rank) for rank in (0, 1)]
    expected = {name: tensor.detach() for name, tensor in reference.state_dict().items()}
    _assert_equal_states(ranks[0]["state"], expected, atol=1e-5)
    _assert_equal_states(ranks[0]["state"], ranks[1]["state"], atol=0)
    assert [rank["syncs"] for rank in ranks] == [steps, steps]


@pytest.mark.slow
def test_spawn_keeps_batchnorm_buffers_identical_and_returns_rank_zero(bn_dropout_cnn: Exported, tmp_path) -> None:
    artifacts = bn_dropout_cnn.artifacts
    module = ddp_run.train(artifacts.directory, tmp_path, kind="cnn", strategy="ort_ddp_spawn", devices=2,
                           batch=BATCH, steps=3)
    first, second = ddp_run.load(tmp_path, 0), ddp_run.load(tmp_path, 1)
    _assert_equal_states(first["state"], second["state"], atol=0)
    assert first["syncs"] == 3
    initial = ORTLightningModule(artifacts).state_dict()
    for name in artifacts.manifest.buffers:
        assert not torch.equal(first["state"][name], initial[name]), name
    # the spawn launcher hands rank 0's weights back to the module of the main process
    _assert_equal_states({n: t.detach() for n, t in module.state_dict().items()}, first["state"], atol=0)


def _fit(module: ORTLightningModule, strategy: Any, **options: Any) -> L.Trainer:
    x, y = ddp_run.dataset("mlp", 64)
    trainer = quiet_trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2,
                            use_distributed_sampler=False, **options)
    trainer.fit(module, datamodule=ddp_run.RankSlices(x, y, BATCH))
    return trainer


@pytest.mark.parametrize(
    ("strategy", "suggestion"),
    [pytest.param("ddp", "ort_ddp", id="ddp"),
     pytest.param("ddp_spawn", "ort_ddp_spawn", id="ddp_spawn", marks=pytest.mark.slow)],  # spawns a rank
)
def test_lightning_ddp_is_refused_before_any_step(mlp_adamw: Exported, strategy: str, suggestion: str) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    before = {n: t.detach().clone() for n, t in module.state_dict().items()}
    # NOTE: under spawn the error is raised in the child process and re-raised by torch.multiprocessing.
    error = ConfigurationError if strategy == "ddp" else Exception
    with pytest.raises(error, match=rf"cannot train under DDPStrategy.*use Trainer\(strategy=\"{suggestion}\"\)"):
        _fit(module, strategy)
    _assert_equal_states({n: t.detach() for n, t in module.state_dict().items()}, before, atol=0)


class _CutGradients(L.Callback):
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        pl_module.get_parameter("fc1.weight").grad = None


def test_a_cut_gradient_view_is_bound_again_before_the_all_reduce(mlp_adamw: Exported) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    before = module.get_parameter("fc1.weight").detach().clone()
    trainer = _fit(module, "ort_ddp", callbacks=[_CutGradients()])
    assert trainer.strategy.gradient_syncs == 2
    weight = module.get_parameter("fc1.weight")
    (view,) = [grad for parameter, grad in module.live_session.views.gradients.pairs if parameter is weight]
    assert weight.grad is view, "the view of ORT's gradient buffer is .grad again"
    assert not torch.equal(weight.detach(), before), "the update reached the parameter whose .grad was cut"


def test_single_rank_ort_ddp_trains_like_one_process(mlp_adamw: Exported) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.01)
    trainer = _fit(module, ORTDDPStrategy(bucket_cap_mb=0.001))
    assert isinstance(trainer.strategy, ORTDDPStrategy)
    assert trainer.strategy.gradient_syncs == 2
    # The reference: plain torch, the same two batches, torch's AdamW and ORT's linear decay over 2 steps.
    reference = mlp_adamw.reference()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (2 - step) / 2)
    x, y = ddp_run.dataset("mlp", 64)
    for batch in range(2):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(reference(x[batch * BATCH:(batch + 1) * BATCH]),
                                          y[batch * BATCH:(batch + 1) * BATCH]).backward()
        optimizer.step()
        schedule.step()
    expected = {name: p.detach() for name, p in reference.named_parameters()}
    _assert_equal_states({n: p.detach() for n, p in module.named_parameters()}, expected, atol=1e-6)
    initial = mlp_adamw.reference().state_dict()
    assert max((initial[n] - expected[n]).abs().max().item() for n in expected) > 1e-3


def test_bucket_size_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match=r"`bucket_cap_mb` to be positive, but got 0"):
        ORTDDPStrategy(bucket_cap_mb=0)


def test_buckets_group_by_dtype_and_close_at_the_cap() -> None:
    tensors = [torch.ones(4), torch.ones(2, dtype=torch.int64), torch.ones(3), torch.ones(5), torch.ones(1)]
    buckets = plan_buckets(tensors, bucket_bytes=16)
    assert [(b.flat.dtype, b.flat.numel()) for b in buckets] == [
        (torch.float32, 4), (torch.float32, 8), (torch.float32, 1), (torch.int64, 2)
    ]
    for bucket in buckets:
        bucket.pack()
        bucket.flat.mul_(2)
        bucket.unpack()
    assert all(torch.equal(t, torch.full_like(t, 2)) for t in tensors)


def test_ort_threads_stop_spinning_when_ranks_share_the_cpu() -> None:
    two_ranks = L.Trainer(strategy="ort_ddp", accelerator="cpu", devices=2, logger=False)
    one_rank = L.Trainer(strategy="ort_ddp", accelerator="cpu", devices=1, logger=False)
    forced = L.Trainer(strategy=ORTDDPStrategy(allow_spinning=True), accelerator="cpu", devices=2, logger=False)
    assert thread_spinning(two_ranks.strategy) is False
    assert thread_spinning(one_rank.strategy) is True
    assert thread_spinning(forced.strategy) is True


def test_a_session_rebuilt_without_spinning_keeps_training_from_where_it_was(mlp_adamw: Exported) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts)
    assert module.ort_session.spinning is True
    before = module.get_parameter("fc1.weight").detach().clone()
    trainer = _fit(module, ORTDDPStrategy(allow_spinning=False))
    assert module.ort_session.spinning is False
    weight = module.get_parameter("fc1.weight")
    assert not torch.equal(weight.detach(), before), "the rebuilt session trained"
    views = {view.name: view for view in parameter_views(module.ort_session)}
    assert weight.data_ptr() == views["fc1.weight"].data.data_ptr(), "the parameter is a view of the new session"
    assert trainer.strategy.gradient_syncs == 2
