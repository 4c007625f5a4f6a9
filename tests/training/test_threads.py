"""The thread policy: what it changes during a fit, what it gives back, what it never touches.

Real artifacts, a real Trainer, real ORT; torch's own thread count (``torch.get_num_threads``)
is the observable, read by a callback inside the fit and by the test after it.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import pytest
import torch

from ort_lightning import ORTDDPStrategy, ORTLightningModule
from ort_lightning.errors import ConfigurationError
from ort_lightning.training.threads.policy import ThreadPolicy, available_cores, user_torch_threads
from tests.conftest import THREAD_ENVIRONMENT, Exported
from tests.training.torch_loop import blob_loader, parity_trainer

STEPS = 24
_one_core = pytest.mark.skipif(available_cores() < 2, reason="the policy changes nothing torch does on one core")


def multicore(test: Callable[..., None]) -> Callable[..., None]:
    """A test of the policy across cores: `alone`, so that .ci/run runs it alone and unpinned (conftest.py)."""
    return pytest.mark.alone(_one_core(test))


class _ThreadProbe(L.Callback):
    """Records torch's thread count in every training batch; raises at `fail_at` when given."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.seen: list[int] = []
        self.fail_at = fail_at

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.seen.append(torch.get_num_threads())
        if self.fail_at is not None and len(self.seen) == self.fail_at:
            raise RuntimeError("a failure inside fit")


def _recording(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    class Recording(base):  # type: ignore[valid-type,misc]
        seen: list[int] = []

        def step(self, closure: Any = None) -> Any:
            type(self).seen.append(torch.get_num_threads())
            return super().step(closure)

    return Recording


@pytest.fixture
def default_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """torch at its default thread count (the policy's precondition), given back as it was after the test.

    The thread variables are those the session started with: an earlier test (Ray, a DDP launcher)
    may have set them in this process.
    """
    for name, value in THREAD_ENVIRONMENT.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    chosen, why = user_torch_threads()
    if chosen:
        pytest.skip(f"torch's threads are set by the environment: {why}")
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def _tuned(module: ORTLightningModule) -> ORTLightningModule:
    """Make the module's policy measure its candidates within a short fit (warm-up 1, 3 batches each)."""
    policy = module.thread_policy
    policy.min_fit_steps, policy.warmup, policy.block, policy.rounds = 0, 1, 3, 1
    return module


@multicore
def test_torch_threads_are_lowered_during_the_fit_and_restored_after(
    mlp_adamw: Exported, default_threads: int
) -> None:
    probe = _ThreadProbe()
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.01)
    parity_trainer(max_steps=STEPS, callbacks=[probe]).fit(module, blob_loader())
    assert probe.seen == [1] * STEPS  # a short fit keeps the first candidate, unmeasured
    assert "unmeasured" in module.thread_policy.reason
    assert torch.get_num_threads() == default_threads
    assert module.ort_session.intra_op_threads == available_cores()


@multicore
def test_threads_are_restored_after_an_exception_inside_fit(mlp_adamw: Exported, default_threads: int) -> None:
    probe = _ThreadProbe(fail_at=5)
    module = _tuned(ORTLightningModule(mlp_adamw.artifacts, lr=0.01))
    with pytest.raises(RuntimeError, match="a failure inside fit"):
        parity_trainer(max_steps=STEPS, callbacks=[probe]).fit(module, blob_loader())
    assert probe.seen[0] == 1
    assert torch.get_num_threads() == default_threads


@multicore
def test_the_candidates_are_measured_and_the_choice_is_kept(
    mlp_adamw: Exported, default_threads: int, caplog: pytest.LogCaptureFixture
) -> None:
    probe = _ThreadProbe()
    module = _tuned(ORTLightningModule(mlp_adamw.artifacts, lr=0.01))
    with caplog.at_level("INFO", logger="ort_lightning.training.threads.policy"):
        parity_trainer(max_steps=STEPS, callbacks=[probe]).fit(module, blob_loader())
    plan = 1 + 3 * len(module.thread_policy.candidates(available_cores(), session=True))
    choice = module.thread_policy.choice
    assert choice is not None
    assert module.thread_policy.reason.startswith("measured per step")
    assert set(probe.seen[plan:]) == {choice.torch_threads}
    logged = [r.message for r in caplog.records if r.name == "ort_lightning.training.threads.policy"]
    assert len(logged) == 1
    assert logged[0].startswith(f"Thread policy: {choice.name}, the fastest of")
    assert torch.get_num_threads() == default_threads


class _TorchHeavy(ORTLightningModule):
    """A module whose own torch work (a 1536 x 1536 product per batch, frozen) outweighs ORT's step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.square = torch.randn(1536, 1536, generator=torch.Generator().manual_seed(0))

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        torch.mm(self.square, self.square)
        return batch


@pytest.mark.alone  # two torch threads beat one only when no other process takes the second core
@multicore
def test_a_fit_whose_own_torch_work_outweighs_orts_keeps_torchs_threads(
    mlp_adamw: Exported, default_threads: int
) -> None:
    probe = _ThreadProbe()
    module = _tuned(_TorchHeavy(mlp_adamw.artifacts, lr=0.01))
    parity_trainer(max_steps=STEPS, callbacks=[probe]).fit(module, blob_loader())
    choice = module.thread_policy.choice
    assert choice is not None
    assert module.thread_policy.reason.startswith("measured per step"), module.thread_policy.reason
    assert choice.torch_threads == available_cores(), module.thread_policy.reason
    plan = 1 + 3 * len(module.thread_policy.candidates(available_cores(), session=True))
    assert set(probe.seen[plan:]) == {available_cores()}
    assert torch.get_num_threads() == default_threads


@multicore
def test_a_torch_optimizer_updates_on_one_thread_beside_spinning_ort(
    mlp_adamw: Exported, default_threads: int
) -> None:
    optimizer = _recording(torch.optim.AdamW)
    optimizer.seen = []
    probe = _ThreadProbe()
    module = ORTLightningModule(mlp_adamw.artifacts, optimizer=lambda p: optimizer(p, lr=0.01), lr_scheduler="constant")
    assert module.ort_session.spinning is True
    parity_trainer(max_steps=STEPS, callbacks=[probe]).fit(module, blob_loader())
    assert set(optimizer.seen) == {1}
    assert set(probe.seen) == {1}
    assert torch.get_num_threads() == default_threads


class _SessionProbe(L.Callback):
    """Records ORT's spinning and pool size in every training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[bool, int]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        session = pl_module.ort_session  # type: ignore[attr-defined]
        self.seen.append((session.spinning, session.intra_op_threads))


@multicore
def test_ort_on_one_thread_is_measured_between_steps(
    mlp_adamw: Exported, default_threads: int
) -> None:
    probe = _SessionProbe()
    module = _tuned(ORTLightningModule(mlp_adamw.artifacts, lr=0.01))
    parity_trainer(max_steps=STEPS, callbacks=[probe]).fit(module, blob_loader())
    cores = available_cores()
    assert {(True, cores), (True, 1)} <= set(probe.seen)
    choice = module.thread_policy.choice
    assert choice is not None
    expected = (True, choice.ort_threads or cores)
    assert probe.seen[-1] == expected == (module.ort_session.spinning, module.ort_session.intra_op_threads)


@multicore
def test_a_later_fit_keeps_the_measured_choice(mlp_adamw: Exported, default_threads: int) -> None:
    module = _tuned(ORTLightningModule(mlp_adamw.artifacts, lr=0.01))
    parity_trainer(max_steps=STEPS).fit(module, blob_loader())
    measured = module.thread_policy.choice
    module.thread_policy.min_fit_steps = 10_000  # the next fit is too short to measure anything
    probe = _SessionProbe()
    parity_trainer(max_steps=4, callbacks=[probe]).fit(module, blob_loader())
    assert module.thread_policy.choice == measured
    assert module.thread_policy.reason.startswith("measured in an earlier fit")
    assert measured is not None
    assert set(probe.seen) == {(True, measured.ort_threads or available_cores())}


def test_ort_session_is_not_rebuilt_under_accumulation(mlp_adamw: Exported, default_threads: int) -> None:
    probe = _SessionProbe()
    module = _tuned(ORTLightningModule(mlp_adamw.artifacts, lr=0.01))
    parity_trainer(max_steps=STEPS // 2, callbacks=[probe], accumulate_grad_batches=2).fit(module, blob_loader())
    assert set(probe.seen) == {(True, available_cores())}


def _parameters_after(exported: Exported, threads: str, **options: Any) -> dict[str, torch.Tensor]:
    module = ORTLightningModule(exported.artifacts, lr=0.01, threads=threads, **options)
    _tuned(module)
    parity_trainer(max_steps=STEPS).fit(module, blob_loader())
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.mark.parametrize(
    "options",
    [pytest.param({}, id="ort-adamw"),
     pytest.param({"optimizer": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True), "lr_scheduler": "constant"},
                  id="hybrid-fused-adamw")],
)
def test_the_parameters_are_bit_identical_with_the_policy_on_and_off(
    mlp_adamw: Exported, default_threads: int, options: dict[str, Any]
) -> None:
    on = _parameters_after(mlp_adamw, "auto", **options)
    off = _parameters_after(mlp_adamw, "off", **options)
    assert on.keys() == off.keys()
    for name, value in off.items():
        assert torch.equal(on[name], value), name


def test_a_thread_count_the_user_set_is_left_alone(mlp_adamw: Exported, default_threads: int) -> None:
    mine = default_threads + 1
    torch.set_num_threads(mine)
    probe = _ThreadProbe()
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.01)
    parity_trainer(max_steps=8, callbacks=[probe]).fit(module, blob_loader())
    assert set(probe.seen) == {mine}
    assert torch.get_num_threads() == mine
    assert "torch.set_num_threads" in module.thread_policy.reason


def test_omp_num_threads_in_the_environment_is_left_alone(
    mlp_adamw: Exported, default_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", str(default_threads))
    probe = _ThreadProbe()
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.01)
    parity_trainer(max_steps=8, callbacks=[probe]).fit(module, blob_loader())
    assert set(probe.seen) == {default_threads}
    assert "OMP_NUM_THREADS" in module.thread_policy.reason


def test_threads_off_changes_nothing(mlp_adamw: Exported, default_threads: int) -> None:
    probe = _ThreadProbe()
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.01, threads="off")
    parity_trainer(max_steps=8, callbacks=[probe]).fit(module, blob_loader())
    assert set(probe.seen) == {default_threads}
    assert (module.ort_session.spinning, module.ort_session.intra_op_threads) == (True, 0)


def test_ranks_sharing_the_cpu_share_ort_threads_and_an_explicit_spinning_wins() -> None:
    two = L.Trainer(strategy="ort_ddp", accelerator="cpu", devices=2, logger=False)
    forced = L.Trainer(strategy=ORTDDPStrategy(allow_spinning=True), accelerator="cpu", devices=2, logger=False)
    policy = ThreadPolicy("auto")
    assert ThreadPolicy().session_threads(two.strategy) == max(1, available_cores() // 2)
    assert policy.spinning(forced.strategy) is True
    assert policy.spinning(two.strategy) is False


def test_an_unknown_threads_option_is_refused(mlp_adamw: Exported) -> None:
    message = r"Expected argument `threads` to be one of \('auto', 'off', 'single'\)"
    with pytest.raises(ConfigurationError, match=message):
        ORTLightningModule(mlp_adamw.artifacts, threads="fast")


def test_single_runs_ort_on_one_thread_that_does_not_spin_and_leaves_torch_alone(mlp_adamw: Exported) -> None:
    before = torch.get_num_threads()
    module = ORTLightningModule(mlp_adamw.artifacts, lr=0.01, threads="single")
    parity_trainer(max_steps=3).fit(module, blob_loader())
    assert (module.ort_session.spinning, module.ort_session.intra_op_threads) == (False, 1)
    assert module.thread_policy.choice is None  # nothing measured
    assert torch.get_num_threads() == before


_PER_STEP = ("on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
             "on_before_zero_grad", "on_train_batch_end", "on_validation_batch_start", "on_validation_batch_end")


class _DispatchProbe(L.Callback):
    """Records, per batch, which per-step hooks of the policy Lightning would still call (callable ones)."""

    def __init__(self, policy: ThreadPolicy) -> None:
        self.policy = policy
        self.live: list[set[str]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.live.append({name for name in _PER_STEP if callable(getattr(self.policy, name))})


@multicore
def test_a_policy_that_has_decided_leaves_lightnings_per_step_dispatch(
    mlp_adamw: Exported, default_threads: int
) -> None:
    module = _tuned(ORTLightningModule(mlp_adamw.artifacts, lr=0.01))
    module.thread_policy.revisit_factor = 0  # no watch: nothing is left to do once the choice is made
    probe = _DispatchProbe(module.thread_policy)
    parity_trainer(max_steps=STEPS, callbacks=[probe]).fit(module, blob_loader())
    plan = 1 + 3 * len(module.thread_policy.candidates(available_cores(), session=True))
    assert probe.live[0] == {"on_train_batch_end"}  # the trial times batch ends, nothing else
    assert probe.live[plan:] == [set()] * (STEPS - plan)
    assert all(callable(getattr(module.thread_policy, name)) for name in _PER_STEP)  # a later fit dispatches again


class _StallsLater(ORTLightningModule):
    """A module whose steps slow down by 30 ms from batch `at` on (a stall the choice now suffers from)."""

    at = 20

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.trainer.global_step >= self.at:
            time.sleep(0.03)
        return batch


@multicore
def test_a_choice_whose_steps_stall_is_measured_again_once(
    mlp_adamw: Exported, default_threads: int, caplog: pytest.LogCaptureFixture
) -> None:
    module = _tuned(_StallsLater(mlp_adamw.artifacts, lr=0.01))
    module.thread_policy.watch = (2, 1)
    probe = _DispatchProbe(module.thread_policy)
    with caplog.at_level("INFO", logger="ort_lightning.training.threads.policy"):
        parity_trainer(max_steps=_StallsLater.at + 16, callbacks=[probe]).fit(module, blob_loader())
    logged = [r.message for r in caplog.records if r.name == "ort_lightning.training.threads.policy"]
    assert len(logged) == 3, logged  # the choice, the stall noticed, the choice measured again
    assert "measuring the candidates again" in logged[1]
    assert probe.live[-1] == set()  # one revisit per fit: the watch is gone after it


@multicore
def test_a_session_rebuilt_by_the_trial_is_freed(mlp_adamw: Exported, default_threads: int) -> None:
    module = _tuned(ORTLightningModule(mlp_adamw.artifacts, lr=0.01))
    sessions: list[weakref.ref[Any]] = []

    class _Sessions(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            if not sessions or sessions[-1]() is not module.ort_session:
                sessions.append(weakref.ref(module.ort_session))

    parity_trainer(max_steps=STEPS, callbacks=[_Sessions()]).fit(module, blob_loader())
    gc.collect()
    assert len(sessions) >= 2  # the trial ran ORT on one thread: a rebuilt session
    assert [ref() is not None for ref in sessions].count(True) == 1
    assert sessions[-1]() is module.ort_session
