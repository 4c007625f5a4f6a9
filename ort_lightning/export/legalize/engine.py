"""Legalization: rewrite the nodes ORT 1.19.2's gradient builder cannot take into exact equivalents.

`RULES` is the one table: ONNX op -> rewrite, with the reason. A rewrite replaces one node (or
returns a `Declined` saying why not, logged at DEBUG); parameters keep their torch names.

Example::

    >>> import onnx
    >>> from onnx import helper
    >>> info = helper.make_tensor_value_info
    >>> graph = helper.make_graph([helper.make_node("HardSwish", ["x"], ["y"], name="/act/HardSwish")], "g",
    ...     [info("x", onnx.TensorProto.FLOAT, ["batch", 4])], [info("y", onnx.TensorProto.FLOAT, ["batch", 4])])
    >>> legalize(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    ['/act/HardSwish']
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from ort_lightning.errors import ExportError
from ort_lightning.export.legalize.declined import Declined, Replacement
from ort_lightning.export.legalize.graph import SHAPE_INFERENCE_ERRORS, Graph, where
from ort_lightning.export.legalize.rewrites import gather as _gather
from ort_lightning.export.legalize.rewrites import layers as _layers
from ort_lightning.export.legalize.rewrites import pointwise as _rewrites
from ort_lightning.export.legalize.rewrites import recurrent as _recurrent
from ort_lightning.export.legalize.rewrites import spatial as _spatial
from ort_lightning.export.onnx_nodes import is_ai_onnx

__all__ = ["RULES", "Rule", "explain_gradient_error", "legalize", "padding_rows_of", "raise_explained"]

#: Where a declined rewrite (rule, node, reason) and a failed shape inference are logged, at DEBUG level.
_log = logging.getLogger("ort_lightning.export.legalize")


@dataclass(frozen=True)
class Rule:
    """How one ONNX op is made differentiable by ORT 1.19.2, and why it has to be."""

    rewrite: Callable[[Graph, onnx.NodeProto], Replacement]
    reason: str


_NO_GRADIENT = "no gradient builder in ORT 1.19.2"

#: ONNX op (ai.onnx domain) -> its rewrite. The one place that says what legalization does.
RULES: dict[str, Rule] = {
    "LayerNormalization": Rule(
        _rewrites.layer_norm_outputs,
        "ORT's gradient reads the optional Mean and InvStdDev outputs, which the torch exporter leaves out",
    ),
    "Relu": Rule(
        _rewrites.relu,
        "the CPU ReluGrad is single-threaded and scalar (a fifth of a ResNet step); becomes x * (x > 0), whose "
        "gradient is one vectorized Mul (-inf gives NaN there, 0 in torch)",
    ),
    "HardSigmoid": Rule(_rewrites.hard_sigmoid, f"{_NO_GRADIENT}; becomes Clip(alpha*x + beta, 0, 1)"),
    "HardSwish": Rule(_rewrites.hard_swish, f"{_NO_GRADIENT}; becomes x * Clip(x/6 + 1/2, 0, 1)"),
    "Elu": Rule(_rewrites.elu, f"{_NO_GRADIENT}; becomes relu(x) + alpha*(exp(min(x, 0)) - 1)"),
    "Selu": Rule(_rewrites.selu, f"{_NO_GRADIENT}; becomes gamma * the Elu rewrite"),
    "Celu": Rule(_rewrites.celu, f"{_NO_GRADIENT}; becomes relu(x) + alpha*(exp(min(x, 0)/alpha) - 1)"),
    "Softplus": Rule(
        _rewrites.softplus, f"{_NO_GRADIENT} (nn.Softplus, nn.Mish); becomes x > 20 ? x : log(1 + exp(x)), as torch"
    ),
    "PRelu": Rule(_rewrites.prelu, f"{_NO_GRADIENT} (nn.PReLU); becomes relu(x) + slope*min(x, 0)"),
    "Cast": Rule(
        _rewrites.same_type_cast,
        "ORT drops a Cast to its input's own type (peft's LoRA output, Gemma's RMSNorm) and fails when its output "
        "feeds one node twice (x * x); becomes Identity",
    ),
    "Sign": Rule(_rewrites.sign, f"{_NO_GRADIENT} (nn.LPPool); becomes (x > 0) - (x < 0), gradient-free as Sign's"),
    "ReduceMax": Rule(_rewrites.reduce_max, f"{_NO_GRADIENT} (torch.max/amax over a dim); becomes TopK(k=1)"),
    "ReduceMin": Rule(_rewrites.reduce_min, f"{_NO_GRADIENT} (torch.min/amin over a dim); becomes TopK(k=1, smallest)"),
    "ReduceL2": Rule(_rewrites.reduce_l2, "ORT's gradient graph of it is invalid (torch.norm); becomes sqrt(sum(x*x))"),
    "InstanceNormalization": Rule(
        _rewrites.instance_norm,
        f"{_NO_GRADIENT} (nn.GroupNorm, nn.InstanceNorm*d export to it); becomes ReduceMean arithmetic",
    ),
    "AveragePool": Rule(
        _spatial.average_pool,
        "its gradient reads the static graph shape: a dynamic batch dies with SIGFPE; becomes a ones-kernel Conv",
    ),
    "Resize": Rule(_spatial.resize, "no CPU ResizeGrad kernel (nn.Upsample, F.interpolate); becomes a MatMul per axis"),
    "Slice": Rule(_spatial.reversed_slice, "SliceGrad fails on negative steps (torch.flip); becomes GatherND"),
    "DepthToSpace": Rule(_spatial.depth_to_space, f"{_NO_GRADIENT} (nn.PixelShuffle); becomes Reshape/Transpose"),
    "CumSum": Rule(_spatial.cumsum, f"{_NO_GRADIENT}; becomes a MatMul with a triangular ones matrix"),
    "Pad": Rule(_layers.pad, "the Pad gradient takes constant mode only (reflect, replicate); becomes GatherNDs"),
    "ConvTranspose": Rule(_layers.conv_transpose, "no CPU ConvTransposeGrad kernel; becomes zero insertion + Conv"),
    "LSTM": Rule(
        _recurrent.lstm,
        "the CPU LSTMGrad takes one sample at a time (matrix-vector products): a fixed length up to 256 is unrolled "
        "into MatMul/Sigmoid/Tanh per step; otherwise, the training kernel being forward-only, bidirectional becomes "
        "two LSTMs",
    ),
    "GRU": Rule(_recurrent.gru, "as LSTM (GRUGrad also takes one sample at a time)"),
    "Gather": Rule(
        _gather.gather,
        "ORT's CPU GatherGrad (nn.Embedding's, MultiheadAttention's) locks a mutex per gradient element; a "
        "constant index becomes Slice, others along axis 0 GatherND; with padding_idx the padding row gets no "
        "gradient, as in torch",
    ),
    "RNN": Rule(_recurrent.rnn, f"{_NO_GRADIENT} (nn.RNN); unrolled over its fixed length: MatMul, Tanh/Relu"),
    "Einsum": Rule(_layers.einsum, f"{_NO_GRADIENT}; becomes aligned operands, Mul and ReduceSum"),
    "If": Rule(_rewrites.control_flow, "the gradient builder aborts the process on it: refused with an ExportError"),
    "Loop": Rule(_rewrites.control_flow, "as If"),
    "Scan": Rule(_rewrites.control_flow, "as If"),
}

def legalize(
    proto: onnx.ModelProto, *, padding_rows: dict[str, int] | None = None, weights_dir: Path | None = None
) -> list[str]:
    """Rewrite, in place, every node of `proto` that `RULES` covers; return the rewritten nodes' names.

    Raises:
        ExportError: when a covered node cannot be rewritten (the message names the node).
    """
    graph = Graph(proto, padding_rows=padding_rows, weights_dir=weights_dir)
    rewritten: list[str] = []
    declined: list[tuple[str, str, str]] = []
    nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(proto.graph.node):
        rule = RULES.get(node.op_type)  # NOTE: the domain is asked only of the ops a rule covers
        replacement = rule.rewrite(graph, node) if rule is not None and is_ai_onnx(node) else None
        if isinstance(replacement, Declined):
            declined.append((node.op_type, node.name or f"{node.op_type}_{index}", replacement.reason))
            replacement = None
        if replacement is None:
            nodes.append(node)
            continue
        rewritten.append(node.name or f"{node.op_type}_{index}")
        nodes.extend(replacement)
    for op, name, reason in declined:
        _log.debug("rule %s declined node %r: %s", op, name, reason)
    if rewritten:
        del proto.graph.node[:]
        proto.graph.node.extend(nodes)
        _record_shapes(proto)
    return rewritten


def _record_shapes(proto: onnx.ModelProto) -> None:
    """Write the shapes ONNX inference finds into the graph's value_info.

    NOTE: ORT's own inference cannot see through a Reshape to a computed shape; a later MaxPool
    gradient then reads 0 and the step fails.
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except SHAPE_INFERENCE_ERRORS as error:  # ORT then infers alone
        _log.debug("shape inference of the legalized graph failed, ORT infers alone: %s", error)
        return
    known = {info.name for info in proto.graph.value_info}
    proto.graph.value_info.extend(info for info in inferred.graph.value_info if info.name not in known)


def padding_rows_of(model: object) -> dict[str, int]:
    """``{"<embedding>.weight": padding_idx}`` for every nn.Embedding of a torch model with a padding_idx."""
    if not isinstance(model, torch.nn.Module):
        return {}
    return {
        f"{name}.weight" if name else "weight": int(module.padding_idx)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None
    }


#: What ORT says when it cannot differentiate an op, and what that means for the user.
_NO_GRADIENT_MESSAGES = (
    (re.compile(r"gradient builder has not been registered: ?(?P<op>[A-Za-z0-9_]+)"), "ORT 1.19.2 has no gradient for"),
    (
        re.compile(r"(?P<domain>[A-Za-z0-9_.]+):(?P<op>[A-Za-z0-9_]+)\(-?\d+\) is not a registered function/op"),
        "ORT 1.19.2 neither knows nor can differentiate",
    ),
)


def explain_gradient_error(proto: onnx.ModelProto, message: str) -> str | None:
    """Say which node, of which torch module, ORT could not differentiate; None if `message` does not say."""
    for pattern, lead in _NO_GRADIENT_MESSAGES:
        match = pattern.search(message)
        nodes = [node for node in proto.graph.node if match is not None and node.op_type == match.group("op")]
        if nodes:
            more = f" and {len(nodes) - 1} more node(s) of that op" if len(nodes) > 1 else ""
            return (
                f"{lead} {where(nodes[0])}{more}, and ort-lightning has no rewrite for it (see docs/ops.md); "
                "replace that layer with one docs/ops.md lists as trainable, freeze everything before it and "
                "feed its output as an input, or train that part in torch."
            )
    return None


def raise_explained(proto: onnx.ModelProto, error: ExportError) -> None:
    """Raise a clearer `ExportError` naming the node and module when `error` is a missing gradient."""
    explained = explain_gradient_error(proto, str(error))
    if explained is not None:
        raise ExportError(explained) from error
