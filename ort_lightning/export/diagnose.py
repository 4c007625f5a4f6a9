"""Why torch's exporter failed, told in the user's terms: the operator, the argument, the module, the fix.

The failing node is read back from torch's traceback: its kind is the operator, its scope the
module that called it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import TracebackType

import torch

from ort_lightning.errors import ExportError
from ort_lightning.export.symbolics import SYMBOLICS

__all__ = ["FailedConversion", "conversion_error", "failed_conversion", "input_error"]

_OP = re.compile(r"'?\b((?:aten|prim|onnx|quantized)::\w+)")
_ARGUMENT = re.compile(r"\bif (\w+) is (\w+)")
#: Where torch's messages stop saying why (a request for pull requests, a dump of the TorchScript graph).
_TAIL = re.compile(r"\s*(?:Please feel free to request support|\[Caused by the value|\n)")


@dataclass(frozen=True)
class FailedConversion:
    """The node torch's exporter could not convert."""

    op: str  # the aten op, "aten::col2im"
    module: str | None  # the dotted path of the module that called it, "body.0.fold" ("" for the model itself)
    module_type: str | None  # that module's class name
    argument: str | None  # the argument that has no conversion, "enable_gqa=True", when torch names one
    torch_says: str  # torch's reason, its first sentence or two


def _failed_node(traceback: TracebackType | None) -> torch._C.Node | None:
    """The innermost graph node the exporter was converting when it raised (a ``node`` local of its frames)."""
    found = None
    while traceback is not None:
        node = traceback.tb_frame.f_locals.get("node")
        if isinstance(node, torch._C.Node):
            found = node
        traceback = traceback.tb_next
    return found


def _module_of(scope: str, prefix: str | None) -> tuple[str | None, str | None]:
    """``"Net::/Inner::body.0/torch.nn.Fold::fold"`` -> ``("body.0.fold", "Fold")``, less the adapter's prefix."""
    if not scope:
        return None, None
    parts = [part.split("::", 1) for part in scope.split("/")]
    names = [name for _, name in parts[1:] if name]
    path = ".".join(names)
    if prefix and (path + ".").startswith(prefix):
        path = path[len(prefix):]
    return path, parts[-1][0].rsplit(".", 1)[-1]


def _torch_says(error: BaseException) -> str:
    text = str(error).strip()
    return _TAIL.split(text, maxsplit=1)[0].rstrip(". ")


def failed_conversion(error: BaseException, *, prefix: str | None = None) -> FailedConversion | None:
    """What node `error` (from ``torch.onnx.export``) failed to convert, without the adapter's `prefix`; None else."""
    node = _failed_node(error.__traceback__)
    says = _torch_says(error)
    if node is not None:
        op, (module, module_type) = node.kind(), _module_of(node.scopeName(), prefix)
    else:
        named = _OP.search(str(error))
        if named is None:
            return None
        op, module, module_type = named.group(1), None, None
    argument = _ARGUMENT.search(says)
    return FailedConversion(op, module, module_type, f"{argument[1]}={argument[2]}" if argument else None, says)


def _eager_attention_helps(model: torch.nn.Module, failure: FailedConversion) -> bool:
    """Whether the op sits in a transformers model's attention that has an eager implementation to switch to."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is None or implementation == "eager":
        return False
    where = f"{failure.op} {failure.module or ''} {failure.module_type or ''}".lower()
    return "attention" in where or "attn" in where


def _remedy(model: torch.nn.Module, failure: FailedConversion) -> str:
    if _eager_attention_helps(model, failure):
        return (
            f"build or load the model with attn_implementation=\"eager\" (its attention is then plain MatMul and "
            f"Softmax, which convert), or report {failure.op} to ort-lightning with this message"
        )
    return (
        f"replace that call with ops torch exports at opset 17, or export the model to ONNX yourself "
        f"(ai.onnx opset <= 21) and pass the file; if ort-lightning should convert {failure.op}, report it with "
        "this message"
    )


def conversion_error(error: BaseException, model: torch.nn.Module, *, prefix: str | None, opset: int) -> ExportError:
    """The `ExportError` for a failed ``torch.onnx.export`` of `model`, naming operator, argument, module and fix.

    Example::

        >>> import torch
        >>> from ort_lightning.export.source import torch_to_onnx
        >>> try:
        ...     torch_to_onnx(torch.nn.Fold((3, 3), 2), (torch.zeros(1, 4, 4),), input_names=["x"])
        ... except Exception as error:
        ...     print(str(error).split(": ", 1)[1].split(";")[0])
        torch's exporter has no conversion of aten::col2im at opset 17, called in Fold.forward itself
    """
    name = type(model).__name__
    failure = failed_conversion(error, prefix=prefix)
    if failure is None:
        return ExportError(
            f"torch.onnx.export failed for {name} although its forward runs on example_inputs: "
            f"{type(error).__name__}: {_torch_says(error)}. Export the model to ONNX yourself (ai.onnx opset <= 21) "
            "and pass the file, or report this message to ort-lightning."
        )
    argument = f" with {failure.argument}" if failure.argument else ""
    if failure.module is None:
        where = ""
    elif failure.module == "":
        where = f", called in {name}.forward itself"
    else:
        where = f", called in module '{failure.module}' ({failure.module_type})"
    if failure.op in SYMBOLICS:  # the package's own conversion refused: its message says what to do
        return ExportError(f"torch.onnx.export cannot convert {name}: {failure.op}{where}: {failure.torch_says}.")
    return ExportError(
        f"torch.onnx.export cannot convert {name}: torch's exporter has no conversion of {failure.op}{argument} "
        f"at opset {opset}{where}; torch says: {failure.torch_says}. To export, {_remedy(model, failure)}."
    )


def input_error(error: BaseException, model: torch.nn.Module, shapes: list[str]) -> ExportError:
    """The `ExportError` for a forward that raises on the example inputs: those are the cause."""
    return ExportError(
        f"{type(model).__name__}'s forward fails on example_inputs {shapes}: {type(error).__name__}: "
        f"{_torch_says(error)}. Check that example_inputs is what the model's forward takes (their number, "
        "order or keywords, shapes and dtypes)."
    )
