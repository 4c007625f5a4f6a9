"""What the package's Lightning adapters rely on is still Lightning's: private names, signatures, calls.

Two adapters: ``ModelCheckpointAdapter`` (``ModelCheckpoint``'s private file methods) and
``fresh_loops`` (the Trainer's private fit and epoch loop classes). A Lightning release that
renames, re-signs or stops calling one of them fails here, naming it, instead of silently changing
which ORT checkpoint files a fit leaves or how many steps a reused Trainer trains.
"""

from __future__ import annotations

import inspect
import os
from collections import Counter
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset

from ort_lightning.training import loops
from ort_lightning.training.checkpointing.lightning_private import (
    FIELDS,
    LIGHTNING_READ,
    OVERRIDDEN,
    ModelCheckpointAdapter,
)
from ort_lightning.training.loops import LOOPS, fresh_loops

pytestmark = [
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore:.*exists and is not empty"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
    pytest.mark.filterwarnings("ignore:You.re resuming from a checkpoint that ended before the epoch ended"),
]

RULES: dict[str, Any] = dict(every_n_train_steps=1, save_top_k=1, save_last=True)
HOOKS = ("write_file", "remove_file", "resumable", "with_progress", "before_top_k")


def _moved(what: str) -> str:
    return (f"{what}: lightning {L.__version__}'s ModelCheckpoint is not the one lightning_private.py was read "
            f"against ({LIGHTNING_READ}); re-read lightning/pytorch/callbacks/model_checkpoint.py and update "
            "ModelCheckpointAdapter.")


def _loops_moved(what: str) -> str:
    return (f"{what}: lightning {L.__version__}'s Trainer loops are not the ones training/loops.py was read "
            f"against ({loops.LIGHTNING_READ}); re-read lightning/pytorch/trainer/trainer.py (where Trainer.__init__ "
            "builds fit_loop and its epoch_loop) and lightning/pytorch/loops/, and update fresh_loops.")


class _Recorder(ModelCheckpointAdapter):
    """Writes empty files and counts each call the adapter hands over."""

    FILE_EXTENSION = ".rec"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.calls: Counter[str] = Counter()
        self.last_files: set[str] = set()

    def write_file(self, trainer: L.Trainer, filepath: str) -> None:
        self.calls["write_file"] += 1
        Path(filepath).parent.mkdir(parents=True, exist_ok=True)
        Path(filepath).touch()

    def remove_file(self, trainer: L.Trainer, filepath: str) -> None:
        self.calls["remove_file"] += 1
        Path(filepath).unlink(missing_ok=True)  # a resumed state may name a file an earlier save replaced

    def resumable(self, trainer: L.Trainer, last_files: set[str]) -> set[str]:
        self.calls["resumable"] += 1
        self.last_files = last_files
        return set()

    def with_progress(self, trainer: L.Trainer, candidates: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.calls["with_progress"] += 1
        return candidates

    def before_top_k(self, trainer: L.Trainer, candidates: dict[str, torch.Tensor]) -> None:
        self.calls["before_top_k"] += 1


class _Saves(Logger):
    """Counts ``after_save_checkpoint`` per checkpoint file extension."""

    def __init__(self) -> None:
        super().__init__()
        self.saves: Counter[str] = Counter()

    @property
    def name(self) -> str:
        return "saves"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.saves[checkpoint_callback.FILE_EXTENSION] += 1


class _Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.steps = 0

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.steps += 1
        return self.layer(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(root: Path, callbacks: list[Callback], max_steps: int) -> L.Trainer:
    return L.Trainer(logger=_Saves(), enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                     callbacks=callbacks, max_steps=max_steps, log_every_n_steps=1)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[L.Trainer, ModelCheckpoint, _Recorder, Path]:
    """Lightning's ModelCheckpoint and the recorder side by side, on the same rules, for 3 steps."""
    root = tmp_path_factory.mktemp("private")
    plain, recorder = ModelCheckpoint(dirpath=root / "plain", **RULES), _Recorder(dirpath=root / "rec", **RULES)
    trainer = _trainer(root, [plain, recorder], max_steps=3)
    trainer.fit(_Linear(), _loader())
    return trainer, plain, recorder, root


@pytest.mark.parametrize("name", sorted(OVERRIDDEN))
def test_each_overridden_private_method_keeps_the_signature_read(name: str) -> None:
    method = getattr(ModelCheckpoint, name, None)
    assert method is not None, _moved(f"ModelCheckpoint.{name} is gone")
    parameters = tuple(inspect.signature(method).parameters)
    assert parameters == OVERRIDDEN[name], _moved(f"ModelCheckpoint.{name}{parameters} was {OVERRIDDEN[name]}")


def test_private_fields_and_the_state_key_helper_are_as_read() -> None:
    fields = vars(ModelCheckpoint(every_n_train_steps=3))
    found = {name: fields.get(name, "missing") for name in FIELDS}
    assert found == {"_last_global_step_saved": 0, "_last_checkpoint_saved": "", "_every_n_train_steps": 3,
                     "_every_n_epochs": 0, "_train_time_interval": None}, _moved(f"fields {found}")
    helper = getattr(Callback, "_generate_state_key", None)
    assert helper is not None, _moved("Callback._generate_state_key is gone")
    assert tuple(inspect.signature(helper).parameters) == ("self", "kwargs"), _moved("_generate_state_key changed")
    # ModelCheckpoint's own key is the adapter's without extras: same fields, same order.
    assert ModelCheckpointAdapter(every_n_train_steps=3).rule_key() == ModelCheckpoint(
        every_n_train_steps=3).state_key.replace("ModelCheckpoint", "ModelCheckpointAdapter", 1)


def test_the_adapter_s_public_names_are_not_lightning_s() -> None:
    taken = [name for name in (*HOOKS, "candidates", "rule_key") if hasattr(ModelCheckpoint, name)]
    assert not taken, _moved(f"ModelCheckpoint now has {taken} itself")


def test_lightning_calls_every_override_and_writes_nothing_behind_it(fitted: Any) -> None:
    trainer, plain, recorder, root = fitted
    # 3 steps, top-1 and last at each: 6 writes; steps 1 and 2's top-1 files replaced.
    assert {name: recorder.calls[name] for name in HOOKS} == {
        "write_file": 6, "remove_file": 2, "resumable": 0, "with_progress": 3, "before_top_k": 3}, _moved(
        f"calls {dict(recorder.calls)}")
    stems = {folder: sorted(p.stem for p in (root / folder).iterdir()) for folder in ("plain", "rec")}
    assert stems["rec"] == stems["plain"] == ["epoch=0-step=3", "last"]
    assert recorder.best_model_path == str(root / "rec" / "epoch=0-step=3.rec")
    assert recorder.last_model_path == str(root / "rec" / "last.rec")
    assert trainer.loggers[0].saves == {".ckpt": 6, ".rec": 6}

    _trainer(root, [plain, recorder], max_steps=4).fit(_Linear(), _loader(), ckpt_path="last")
    assert recorder.calls["resumable"] == 1, _moved("Trainer.fit(ckpt_path='last') no longer asks the callback")
    assert recorder.last_files == {os.path.normpath(root / "rec" / "last.rec")}


def test_a_save_records_what_lightning_s_own_save_records(fitted: Any) -> None:
    trainer, _, _, root = fitted
    changed = {}
    for callback, path in ((ModelCheckpoint(dirpath=root / "a"), root / "a" / "x.ckpt"),
                           (_Recorder(dirpath=root / "b"), root / "b" / "x.rec")):
        before = dict(vars(callback))
        saves = dict(trainer.loggers[0].saves)
        callback._save_checkpoint(trainer, str(path))
        assert path.is_file()
        assert trainer.loggers[0].saves[callback.FILE_EXTENSION] == saves[callback.FILE_EXTENSION] + 1
        after = vars(callback)
        changed[type(callback)] = {
            name: str(value).replace(str(path), "<file>") for name, value in after.items()
            if name not in before or before[name] is not value
        }
    assert changed[_Recorder] == changed[ModelCheckpoint], _moved("ModelCheckpoint._save_checkpoint's body changed")
    assert changed[_Recorder] == {"_last_global_step_saved": str(trainer.global_step),
                                  "_last_checkpoint_saved": "<file>"}


# ----------------------------------------------------------------------------- the Trainer's loops
#: Limits that differ from each other and from Lightning's defaults, so that a swapped or dropped one shows.
LIMITS: dict[str, Any] = dict(min_epochs=1, max_epochs=4, min_steps=2, max_steps=9)


def _bare_trainer(**limits: Any) -> L.Trainer:
    return L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     **limits)


def _held(trainer: L.Trainer, held_as: str) -> Any:
    """The loop `fresh_loops` reads as `held_as`: ``trainer.fit_loop`` or ``trainer.fit_loop.epoch_loop``."""
    fit_loop = getattr(trainer, "fit_loop", None)
    assert fit_loop is not None, _loops_moved("Trainer.fit_loop is gone")
    if held_as == "fit_loop":
        return fit_loop
    epoch_loop = getattr(fit_loop, "epoch_loop", None)
    assert epoch_loop is not None, _loops_moved(f"{type(fit_loop).__name__}.epoch_loop is gone")
    return epoch_loop


def _plain_fields(loop: Any) -> dict[str, Any]:
    return {name: value for name, value in vars(loop).items() if isinstance(value, (int, float, str, type(None)))}


@pytest.mark.parametrize("held_as", sorted(LOOPS))
def test_each_loop_s_constructor_takes_the_limits_read_and_keeps_them(held_as: str) -> None:
    loop = _held(_bare_trainer(**LIMITS), held_as)
    name = type(loop).__name__
    parameters = tuple(inspect.signature(type(loop).__init__).parameters)
    read = ("self", "trainer", *LOOPS[held_as])
    assert parameters == read, _loops_moved(f"{name}.__init__{parameters} was {read}")
    kept = {limit: getattr(loop, limit, "missing") for limit in LOOPS[held_as]}
    assert kept == {limit: LIMITS[limit] for limit in LOOPS[held_as]}, _loops_moved(f"{name} keeps {kept}")


def test_fresh_loops_are_the_loops_a_new_trainer_builds() -> None:
    """Same classes, same limits, same plain fields: Trainer.__init__ sets nothing on them the constructors do not."""
    trainer, new = _bare_trainer(**LIMITS), _bare_trainer(**LIMITS)
    fresh_loops(trainer)
    for held_as in LOOPS:
        loop, expected = _held(trainer, held_as), _held(new, held_as)
        assert type(loop) is type(expected)
        assert _plain_fields(loop) == _plain_fields(expected), _loops_moved(
            f"Trainer.__init__ sets {type(expected).__name__}'s fields to {_plain_fields(expected)}, "
            f"the constructor alone to {_plain_fields(loop)}")


def test_a_second_fit_after_fresh_loops_trains_as_a_new_trainer_does() -> None:
    trainer, module = _bare_trainer(max_steps=3), _Linear()
    trainer.fit(module, _loader())
    assert (module.steps, trainer.global_step) == (3, 3)
    trainer.fit(module, _loader())
    assert module.steps == 3  # the test can fail: without fresh loops a reused Trainer trains no step

    fresh_loops(trainer)
    assert (trainer.global_step, trainer.current_epoch, trainer.max_steps) == (0, 0, 3), _loops_moved(
        "fresh loops do not count from 0")
    trainer.fit(module, _loader())
    assert (module.steps, trainer.global_step) == (6, 3), _loops_moved(f"a second fit ran {module.steps - 3} steps")
