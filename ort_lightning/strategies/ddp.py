"""`ORTDDPStrategy`: distributed data parallel training of ORT artifacts on torch.distributed.

Lightning's `DistributedDataParallel` hooks never fire for ONNX Runtime's gradients. This keeps
the rest of Lightning's DDP and replaces the wrapper with two collectives on the views of ORT's
state: a broadcast from rank 0 at setup, and once per optimizer step a coalesced average of the
gradients (and floating-point buffers). Importing ``ort_lightning`` registers ``"ort_ddp"`` and
``"ort_ddp_spawn"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy, Strategy, StrategyRegistry
from typing_extensions import override

from ort_lightning.errors import ConfigurationError
from ort_lightning.strategies.buckets import DEFAULT_BUCKET_BYTES, CoalescedTensors
from ort_lightning.strategies.peers import lost_rank, one_line_tracebacks

__all__ = ["ORTDDPStrategy", "check_strategy", "thread_spinning", "trains_ort_graphs"]

_SPAWN_METHODS = ("spawn", "fork", "forkserver")


class ORTDDPStrategy(DDPStrategy):
    """Lightning's DDP for `ORTLightningModule`: no DistributedDataParallel wrapper, ORT gradients averaged.

    Args:
        bucket_cap_mb: size of the flat buffers that carry the gradients, as torch DDP's option.
        allow_spinning: whether ORT's idle threads spin; None turns spinning off when several ranks
            share this machine's CPU (spinning threads steal the other ranks' cores).
        **kwargs: what `DDPStrategy` takes, except the DistributedDataParallel options.

    Attributes:
        gradient_syncs: gradient all-reduce rounds run so far, one per optimizer step.
    """

    strategy_name = "ort_ddp"

    def __init__(
        self,
        *,
        bucket_cap_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        allow_spinning: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if not bucket_cap_mb > 0:
            raise ConfigurationError(f"Expected argument `bucket_cap_mb` to be positive, but got {bucket_cap_mb!r}.")
        super().__init__(**kwargs)
        self.allow_spinning = allow_spinning
        self.bucket_bytes = int(bucket_cap_mb * 2**20)
        self.gradient_syncs = 0
        self._gradients: CoalescedTensors | None = None
        self._gradient_key: tuple[int, ...] = ()

    @override
    def configure_ddp(self) -> None:
        """Keep the module unwrapped: its gradients come from ORT, not from autograd."""

    @override
    def setup_distributed(self) -> None:
        """Start the process group as Lightning's DDP does; a lost rank's error then prints as one line."""
        super().setup_distributed()
        one_line_tracebacks()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Set up as Lightning's DDP does, then give every rank rank 0's parameters and buffers."""
        super().setup(trainer)
        module = self.lightning_module
        assert module is not None
        states = [*(p.data for p in module.parameters()), *module.buffers()]
        try:
            CoalescedTensors(states, bucket_bytes=self.bucket_bytes).broadcast(src=0)
        except RuntimeError as error:
            self._raise_lost(error, "the broadcast of rank 0's parameters at setup")
        self._gradients = None

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's barrier; a lost rank raises `DistributedError`."""
        try:
            super().barrier(*args, **kwargs)
        except RuntimeError as error:
            self._raise_lost(error, "a barrier")

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's broadcast; a lost rank raises `DistributedError`."""
        try:
            return super().broadcast(obj, src)
        except RuntimeError as error:
            self._raise_lost(error, "a broadcast")

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's reduce (``sync_dist``, shared decisions); a lost rank raises `DistributedError`."""
        try:
            return super().reduce(tensor, *args, **kwargs)
        except RuntimeError as error:
            self._raise_lost(error, "a reduction of logged values or of a shared decision")

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """Lightning's all-gather; a lost rank raises `DistributedError`."""
        try:
            return super().all_gather(tensor, group, sync_grads)
        except RuntimeError as error:
            self._raise_lost(error, "an all-gather")

    def _raise_lost(self, error: RuntimeError, collective: str) -> NoReturn:
        """Raise `DistributedError` from `error` when a peer rank is gone; raise `error` as it is otherwise."""
        step = _at_step(self.lightning_module)
        lost = lost_rank(error, rank=self.global_rank, world_size=self.world_size, where=f"{collective}{step}")
        if lost is None:
            raise error
        raise lost from error

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Average the ORT gradients across ranks inside the closure (clipping sees them averaged), then step."""
        module = model if isinstance(model, torch.nn.Module) else self.lightning_module
        assert module is not None

        def synchronized() -> Any:
            result = closure()
            self._synchronize(module)
            return result

        return super().optimizer_step(optimizer, synchronized, model, **kwargs)

    def _synchronize(self, module: torch.nn.Module) -> None:
        tensors = _gradients_and_buffers(module)
        key = tuple(t.data_ptr() for t in tensors)
        if self._gradients is None or key != self._gradient_key:
            # NOTE: built lazily and rebuilt when ORT's buffers move (a rebuilt session).
            self._gradients = CoalescedTensors(tensors, bucket_bytes=self.bucket_bytes)
            self._gradient_key = key
        try:  # NOTE: costs nothing until it raises (Python 3.11's exceptions are zero-cost on success)
            self._gradients.all_reduce_mean()
        except RuntimeError as error:
            self._raise_lost(error, "the gradient all-reduce")
        self.gradient_syncs += 1

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"ort_ddp"`` (popen) and ``"ort_ddp_spawn"`` (spawn)."""
        for name, start_method in (("ort_ddp", "popen"), ("ort_ddp_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name,
                    cls,
                    description=f"DDP for ORT artifacts with `start_method` {start_method!r}",
                    start_method=start_method,
                )


def _gradients_and_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    gradients = []
    for name, parameter in module.named_parameters():
        if not parameter.requires_grad:
            continue
        if parameter.grad is None:
            raise ConfigurationError(
                f"Parameter {name!r} has no gradient view: its `.grad` was set to None, which cuts it from "
                "ONNX Runtime's gradient buffer; do not call zero_grad(set_to_none=True) on ORT parameters."
            )
        gradients.append(parameter.grad)
    return [*gradients, *(b for b in module.buffers() if b.is_floating_point())]


def thread_spinning(strategy: Strategy) -> bool:
    """Whether ORT's threads should spin under `strategy`: not with several ranks on one CPU."""
    if not isinstance(strategy, ORTDDPStrategy):
        return True
    if strategy.allow_spinning is not None:
        return strategy.allow_spinning
    return not (strategy.root_device.type == "cpu" and strategy.num_processes > 1)


def trains_ort_graphs(strategy_class: type) -> bool:
    """Tell whether a strategy class can train ORT graphs: one process, or `ORTDDPStrategy`.

    Example::

        >>> from lightning.pytorch.strategies import DDPStrategy
        >>> trains_ort_graphs(DDPStrategy), trains_ort_graphs(ORTDDPStrategy)
        (False, True)
    """
    return not issubclass(strategy_class, ParallelStrategy) or issubclass(strategy_class, ORTDDPStrategy)


def check_strategy(strategy: Strategy) -> None:
    """Refuse a parallel strategy other than `ORTDDPStrategy` before any step (`ConfigurationError`)."""
    if trains_ort_graphs(type(strategy)):
        return
    spawn = getattr(strategy, "_start_method", "popen") in _SPAWN_METHODS
    name = "ort_ddp_spawn" if spawn else "ort_ddp"
    raise ConfigurationError(
        f"ORTLightningModule cannot train under {type(strategy).__name__}: its wrapper hooks torch's autograd, "
        "which never sees the gradients ONNX Runtime computes, so the ranks would silently drift apart; "
        f'use Trainer(strategy="{name}") instead.'
    )


ORTDDPStrategy.register_strategies(StrategyRegistry)


def _at_step(module: Any) -> str:
    """`` at global_step=N`` for a module attached to a Trainer; empty otherwise."""
    if module is None:
        return ""
    try:
        trainer = module.trainer
    except RuntimeError:  # NOTE: Lightning's `trainer` property raises for a module attached to none
        return ""
    return "" if trainer is None else f" at global_step={trainer.global_step}"
