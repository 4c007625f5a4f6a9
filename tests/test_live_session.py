"""The one way to change a running ORT session: a rebuild between two steps changes nothing a fit computes.

The reference is the same fit without the rebuild (ORT's state is copied, not recomputed, so the
weights must agree to the bit), and torch's own ``Linear`` for values copied in place.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from ort_lightning import ORTLightningModule, TrainingArtifacts
from ort_lightning.errors import ArtifactError, ConfigurationError
from ort_lightning.fleet.devices.state_values import get_values
from ort_lightning.ort import runtime
from tests.conftest import Exported
from tests.helpers import ort_deaths
from tests.test_parity import _loader, _trainer

STEPS = 6


def _flipped(module: ORTLightningModule) -> runtime.SessionSettings:
    """The running settings with ORT's spinning flipped (a rebuild that changes no number)."""
    settings = module.live_session.settings
    return dataclasses.replace(settings, spinning=not settings.spinning)


def _ort_parts(session: runtime.TrainingSession) -> tuple[Any, Any, Any]:
    """ORT's Module, Optimizer and CheckpointState of `session`, in the order ORT must free them."""
    state, ort_module, optimizer = session.ort_objects
    return ort_module, optimizer, state


def _module_and_state(session: runtime.TrainingSession) -> tuple[Any, Any]:
    state, ort_module, _ = session.ort_objects
    return ort_module, state


class _Rebuilding(L.Callback):
    """After every batch, rebuilds the module's session with ORT's spinning flipped (no effect on numbers)."""

    def __init__(self) -> None:
        self.sessions: list[Any] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        module: ORTLightningModule = pl_module  # type: ignore[assignment]
        rebuilt = module.live_session.replace(settings=_flipped(module))
        assert rebuilt
        self.sessions.append(module.ort_session)


def _fit(exported: Exported, callbacks: list[L.Callback], **options: Any) -> tuple[ORTLightningModule, L.Trainer]:
    torch.manual_seed(0)
    module = ORTLightningModule(exported.artifacts, lr=0.05, threads="off", lr_scheduler="constant", **options)
    trainer = _trainer(max_steps=STEPS, callbacks=callbacks)
    trainer.fit(module, _loader())
    return module, trainer


@pytest.mark.parametrize(
    "options",
    [{}, {"optimizer": lambda params: torch.optim.AdamW(params, lr=0.05)}],
    ids=["ort-optimizer", "torch-optimizer"],
)
def test_a_rebuild_between_steps_keeps_the_fit_exact(mlp_adamw: Exported, options: dict[str, Any]) -> None:
    plain, _ = _fit(mlp_adamw, [], **options)
    probe = _Rebuilding()
    rebuilt, trainer = _fit(mlp_adamw, [probe], **options)
    assert len({id(session) for session in probe.sessions}) == STEPS
    (optimizer,) = trainer.optimizers
    assert optimizer.session is probe.sessions[-1]  # the optimizer followed every rebuild
    for (name, expected), (_, actual) in zip(plain.named_parameters(), rebuilt.named_parameters(), strict=True):
        assert torch.equal(actual, expected), name


def test_values_alone_are_copied_in_place_and_a_fresh_optimizer_rebuilds(mlp_adamw: Exported) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, threads="off")
    generator = torch.Generator().manual_seed(3)
    values = {name: torch.randn(tensor.shape, generator=generator) for name, tensor in module.named_parameters()}
    session = module.ort_session
    assert module.live_session.replace(values=values) is False
    assert module.ort_session is session
    x = torch.randn(5, 4, generator=generator)
    reference = mlp_adamw.reference().eval()
    reference.load_state_dict(values)
    torch.testing.assert_close(module(x), reference(x), rtol=1e-5, atol=1e-6)
    assert module.live_session.replace(values=values, include_optimizer_state=False) is True
    assert module.ort_session is not session
    torch.testing.assert_close(module(x), reference(x), rtol=1e-5, atol=1e-6)


def test_a_rebuild_frees_the_running_session_before_it_builds_the_next(
    mlp_adamw: Exported, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, threads="off")
    _trainer(max_steps=2).fit(module, _loader())
    old = module.ort_session  # kept, as a user may keep it: it must not keep ORT's objects alive
    alive = [weakref.ref(part) for part in _ort_parts(old)]
    seen: list[list[bool]] = []
    assemble = runtime.assemble

    def watched(**options: Any) -> Any:
        seen.append([ref() is not None for ref in alive])  # at the moment the next session is assembled
        return assemble(**options)

    monkeypatch.setattr(runtime, "assemble", watched)
    before = {name: tensor.clone() for name, tensor in module.named_parameters()}
    assert module.live_session.replace(settings=_flipped(module))
    # one session's memory at a time, not two; other threads on the same device: ORT's state itself goes over
    # (no snapshot file), under a new Module and Optimizer
    assert seen == [[False, False, True]]
    assert module.ort_session.ort_objects[0] is alive[2]()
    for name, tensor in module.named_parameters():
        assert torch.equal(tensor, before[name]), name
    with pytest.raises(ConfigurationError, match="This ORT session was closed: the module rebuilt its session"):
        old.train_step(runtime.OrtValueVector())

    # a rebuild from a snapshot (other values with it) frees the state too before the next is assembled
    running = module.ort_session
    alive[:] = [weakref.ref(part) for part in _ort_parts(running)]
    seen.clear()
    assert module.live_session.replace(settings=_flipped(module), values=before)
    assert seen == [[False, False, False]]


class _FailingRebuild(L.Callback):
    """Once, between two steps, asks for a rebuild that fails midway (misshapen values) and keeps the error."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        module: ORTLightningModule = pl_module  # type: ignore[assignment]
        if trainer.global_step == STEPS // 2:
            values = {name: torch.zeros(3) for name, _ in module.named_parameters()}
            with pytest.raises(ConfigurationError, match="Expected value") as error:
                module.live_session.replace(settings=_flipped(module), values=values)
            self.errors.append(str(error.value))


def test_a_failed_rebuild_leaves_the_running_state(mlp_adamw: Exported) -> None:
    plain, _ = _fit(mlp_adamw, [])
    probe = _FailingRebuild()
    failed, _ = _fit(mlp_adamw, [probe])
    assert len(probe.errors) == 1
    for (name, expected), (_, actual) in zip(plain.named_parameters(), failed.named_parameters(), strict=True):
        assert torch.equal(actual, expected), name  # weights, step and moments came back: the fit went on exactly



def test_a_refused_rebuild_over_the_running_state_gives_the_state_back(mlp_adamw: Exported, tmp_path: Path) -> None:
    """A session built for training alone hands its state over to a build with the eval graph; ORT refuses the
    damaged eval graph; the state comes back, and the module trains on exactly as a module never refused."""
    folder = Path(shutil.copytree(mlp_adamw.artifacts.directory, tmp_path / "artifacts"))
    module = ORTLightningModule(folder, lr=0.05, threads="off", lr_scheduler="constant")
    values = {name: tensor + 0.01 for name, tensor in get_values(module).items()}
    module.load_values(values, evaluation=False)
    eval_graph = folder / TrainingArtifacts.load(folder).eval_model.name
    eval_graph.write_bytes(eval_graph.read_bytes()[:200])
    with pytest.raises(ArtifactError, match="ONNX Runtime cannot load the graphs"):
        module.evaluate_batch(next(iter(_loader())))
    assert module.ort_session.evaluation is False
    for name, tensor in get_values(module).items():
        assert torch.equal(tensor, values[name]), name
    _trainer(max_steps=STEPS).fit(module, _loader())
    never = ORTLightningModule(mlp_adamw.artifacts, lr=0.05, threads="off", lr_scheduler="constant", values=values)
    _trainer(max_steps=STEPS).fit(never, _loader())
    for (name, expected), (_, actual) in zip(never.named_parameters(), module.named_parameters(), strict=True):
        assert torch.equal(actual, expected), name


# ----------------------------------------------------------------------------- ORT's objects die in ORT's order
def _session(artifacts: TrainingArtifacts) -> runtime.TrainingSession:
    return runtime.assemble(training_model=artifacts.training_model, eval_model=artifacts.eval_model,
                            optimizer_model=artifacts.optimizer_model, checkpoint=artifacts.checkpoint)


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_session_frees_orts_module_before_its_state(mlp_adamw: Exported, how: str) -> None:
    # NOTE: ORT's C++ Module writes into its CheckpointState when it is destroyed; a state freed first is
    # written after it is freed (tests.helpers.ort_deaths). The wrapper holds bound calls of the Module, which
    # outlive the Python Module unless the wrapper lets them go first.
    session = _session(mlp_adamw.artifacts)
    deaths = ort_deaths(*_module_and_state(session))
    if how == "close":
        session.close()
        assert deaths == ["Module", "CheckpointState"]
    del session
    gc.collect()
    assert deaths == ["Module", "CheckpointState"]


def test_a_bound_call_kept_past_the_session_keeps_the_state_too(mlp_adamw: Exported) -> None:
    # NOTE: what a probe or a user's code may keep (the overhead benchmark's callback did): ORT's C++ Module, past
    # the session, its Python Module and its state; the state must wait for it.
    session = _session(mlp_adamw.artifacts)
    ort_module, state = _module_and_state(session)
    train = ort_module._model.train_step_with_ort_values  # ORT's C++ Module, bound
    deaths = ort_deaths(ort_module, state)
    del ort_module, state
    session.close()
    del session
    gc.collect()
    assert deaths == []
    del train
    gc.collect()
    assert deaths == ["Module", "CheckpointState"]


def test_a_rebuild_frees_the_old_module_and_keeps_the_state_it_hands_over(mlp_adamw: Exported) -> None:
    module = ORTLightningModule(mlp_adamw.artifacts, threads="off")
    _trainer(max_steps=2).fit(module, _loader())
    old = module.ort_session
    deaths = ort_deaths(*_module_and_state(old))
    assert module.live_session.replace(settings=_flipped(module))
    assert deaths == ["Module"]  # the state went over to the new session
    ort_module, state = _module_and_state(module.ort_session)
    held = ort_deaths(ort_module, state)
    del ort_module
    del old, state, module
    gc.collect()
    assert held == ["Module", "CheckpointState"]
