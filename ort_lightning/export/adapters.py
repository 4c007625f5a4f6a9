"""What the export refuses of a peft model before tracing it: adapters whose gradient ONNX cannot carry.

peft's LoRA, rsLoRA, ``modules_to_save`` and several adapters on one model export as they are: the
frozen base is ``requires_grad=False``, the inactive adapters are never read by the forward, and
every op trains on ONNX Runtime. DoRA (``LoraConfig(use_dora=True)``) is refused: peft divides by
the weight's column norm and detaches that norm from the gradient (as the DoRA paper prescribes),
and torch's ONNX exporter drops ``detach``, so ORT would differentiate through the norm and train
another gradient than torch + peft (58 % off at the first step on a tiny Llama; equal to 6e-6 when
the torch side drops the detach too). peft is never imported: its layers are recognised by their
``use_dora`` and ``active_adapters`` attributes.

NOTE: ONNX has no stop-gradient op, and ORT 1.19.2's gradient builder stops only at fixed edges (indices,
shapes, a Cast to an integer type). Exporting DoRA's detach as ``Cast(Cast(x * 2**40, INT64), FLOAT) *
2**-40`` (exact for |x| in [2**-16, 2**23), as weight norms are) trained equal to torch + peft (step-1
gradients within 2.4e-6) in a probe; a detach conversion limited to such values would lift this refusal.

Example::

    >>> import torch
    >>> refuse_dora(torch.nn.Linear(2, 2))  # nothing to refuse
"""

from __future__ import annotations

import torch

from ort_lightning.errors import ExportError

__all__ = ["refuse_dora"]


def _uses_dora(module: torch.nn.Module) -> bool:
    """Whether `module` is a peft LoRA layer whose active adapter is DoRA."""
    use_dora = getattr(module, "use_dora", None)
    if not isinstance(use_dora, dict):
        return False
    active = getattr(module, "active_adapters", ())
    return any(use_dora.get(adapter, False) for adapter in active)


def refuse_dora(model: object) -> None:
    """Refuse a torch model with an active peft DoRA adapter (see the module docstring for why).

    Raises:
        ExportError: naming the first DoRA layer and what to do instead.
    """
    if not isinstance(model, torch.nn.Module):
        return
    layers = [name for name, module in model.named_modules() if _uses_dora(module)]
    if layers:
        more = f" and {len(layers) - 1} more" if len(layers) > 1 else ""
        raise ExportError(
            f"peft's DoRA (LoraConfig(use_dora=True)) is active in {layers[0]!r}{more}, which ort-lightning cannot "
            "train equal to torch: DoRA detaches its weight norm from the gradient, and torch's ONNX exporter drops "
            "the detach, so ONNX Runtime would compute another gradient. Use LoRA (use_dora=False; use_rslora=True "
            "exports) or train the DoRA adapters in torch."
        )
