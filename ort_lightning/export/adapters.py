"""What the export refuses of a peft model before tracing it: adapters whose gradient ONNX cannot carry.

LoRA, rsLoRA, ``modules_to_save`` and several adapters export as they are. DoRA is refused: peft
detaches the weight's column norm from the gradient, torch's ONNX exporter drops ``detach``, and
ORT would train another gradient than torch + peft. peft is never imported here.

NOTE: ONNX has no stop-gradient op; ORT 1.19.2's gradient builder stops only at fixed edges
(indices, shapes, a Cast to an integer). A detach exported as an exact integer round trip trained
equal to torch + peft in a probe, and would lift this refusal.
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
    """Refuse a torch model with an active peft DoRA adapter (`ExportError` naming the layer and what to do)."""
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
