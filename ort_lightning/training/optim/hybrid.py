"""Hybrid training: ONNX Runtime computes forward and backward, a torch optimizer updates.

``ORTLightningModule(optimizer=factory)`` builds the torch optimizer over the module's parameters,
views of ORT's state whose ``.grad`` are views of ORT's gradient buffers, so its in-place update
writes ORT's weights directly. It pays where ORT's update is slow or missing (SGD with momentum);
ORT's own optimizer graph stays the default, as it is what ships for on-device training.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import ORTLightningModule, export_artifacts
    >>> artifacts = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), tempfile.mkdtemp(), verify=False)
    >>> sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)
    >>> optimizer = ORTLightningModule(artifacts, optimizer=sgd, lr_scheduler="constant").configure_optimizers()
    >>> type(optimizer.optimizer).__name__
    'SGD'
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ort_lightning.bridge import hand_over_to_ort
from ort_lightning.errors import ConfigurationError
from ort_lightning.ort.runtime import TrainingSession
from ort_lightning.training.optim.ort_optimizer import linear_lr_factor, run_closure

__all__ = ["OptimizerFactory", "TorchOverORT", "check_optimizer", "describe_optimizer", "linear_schedule"]

#: What ``ORTLightningModule(optimizer=...)`` takes besides None.
OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

_EXAMPLE = "optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4, fused=True)"


def check_optimizer(optimizer: object) -> None:
    """Refuse an `optimizer` option that is neither None nor a callable (`ConfigurationError`)."""
    if optimizer is None or (callable(optimizer) and not isinstance(optimizer, (str, torch.optim.Optimizer))):
        return
    raise ConfigurationError(
        f"Expected argument `optimizer` to be None (ORT's own optimizer graph) or a callable params -> "
        f"torch.optim.Optimizer, but got {optimizer!r}; pass a factory, e.g. {_EXAMPLE} (an optimizer "
        "instance cannot work: it must be built over the module's ORT-backed parameters)."
    )


def describe_optimizer(optimizer: OptimizerFactory | None) -> str:
    """A name for `optimizer` in the hyper-parameters: ``"ort"`` or the factory's name."""
    if optimizer is None:
        return "ort"
    return getattr(optimizer, "__qualname__", type(optimizer).__name__)


class TorchOverORT(torch.optim.Optimizer):
    """A torch optimizer updating ORT's parameters from ORT's gradients, driven by Lightning.

    ``param_groups``, ``state``, ``defaults`` and ``state_dict`` are the wrapped optimizer's own, so
    clipping, torch schedulers and ``LearningRateMonitor`` work on it as on the torch optimizer.
    """

    def __init__(self, session: TrainingSession, optimizer: torch.optim.Optimizer) -> None:
        super().__init__([p for group in optimizer.param_groups for p in group["params"]], {})
        self.optimizer = optimizer
        self.session = session
        device = torch.device(session.device)
        self._cuda_device = device if device.type == "cuda" else None
        self._alias()

    def follow(self, session: TrainingSession) -> None:
        """Work with `session` from now on; the parameters stay the same objects."""
        self.session = session
        device = torch.device(session.device)
        self._cuda_device = device if device.type == "cuda" else None

    def _alias(self) -> None:
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Run `closure`, then the torch optimizer's update; a closure that returns None skips it."""
        ran, loss = run_closure(closure)
        if not ran:
            return None
        self.optimizer.step()
        if self._cuda_device is not None:
            hand_over_to_ort(self._cuda_device)  # the update ran on torch's stream
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset ORT's gradient buffers; ``.grad`` stays the views of them (torch's would set None)."""
        self.session.lazy_reset_grad()

    def state_dict(self) -> dict[str, Any]:
        """The torch optimizer's state (moments, step counts, param groups)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the torch optimizer's state into the objects Lightning and the schedulers hold."""
        groups, state = self.optimizer.param_groups, self.optimizer.state
        self.optimizer.load_state_dict(state_dict)
        groups[:] = self.optimizer.param_groups
        state.clear()
        state.update(self.optimizer.state)
        self.optimizer.param_groups, self.optimizer.state = groups, state
        self._alias()


def build(factory: OptimizerFactory, session: TrainingSession, params: Sequence[torch.nn.Parameter]) -> TorchOverORT:
    """Call `factory` over the trainable ORT-backed `params` and wrap what it returns.

    Raises:
        ConfigurationError: when the factory returns no torch optimizer, or one holding tensors that
            are not the module's trainable parameters.
    """
    optimizer = factory(list(params))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            f"Expected `optimizer` to return a torch.optim.Optimizer, but it returned {type(optimizer).__name__}; "
            f"write e.g. {_EXAMPLE}."
        )
    ours = {id(p) for p in params}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in ours)
    if foreign:
        raise ConfigurationError(
            f"The optimizer from `optimizer` holds {foreign} tensor(s) that are not the module's trainable "
            "parameters (views of ONNX Runtime's state), so they would never receive ORT's gradients; build it "
            f"over the `params` the factory is given, e.g. {_EXAMPLE}."
        )
    return _facade_class(type(optimizer))(session, optimizer)


_FACADES: dict[type, type[TorchOverORT]] = {}


def _facade_class(kind: type[torch.optim.Optimizer]) -> type[TorchOverORT]:
    # NOTE: named after the torch optimizer, so that LearningRateMonitor logs "lr-AdamW" as it
    # does for a torch module, not the name of this wrapper.
    if kind not in _FACADES:
        _FACADES[kind] = type(kind.__name__, (TorchOverORT,), {"__module__": __name__, "__doc__": TorchOverORT.__doc__})
    return _FACADES[kind]


def linear_schedule(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The linear warmup/decay of `LinearLRSchedule` as a torch scheduler, each group at its own peak lr."""

    def factor(step: int) -> float:
        return linear_lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def trainable(pairs: Iterable[tuple[torch.nn.Parameter, torch.Tensor]]) -> list[torch.nn.Parameter]:
    """The parameters of (parameter, gradient view) pairs, in order."""
    return [parameter for parameter, _ in pairs]
