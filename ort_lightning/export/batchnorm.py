"""BatchNorm running statistics as torch keeps them, rewritten into the training graph.

ORT's ``BatchNormInternal`` updates ``running_var`` with the biased variance, torch with the
unbiased one (``n / (n - 1)``). The rewrite sets the kernel's momentum to 1 (statistics kept) and
writes torch's update after it, in place, through an ``InPlaceAccumulatorV2`` with its overwrite
flag, whatever the device's kernel does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ort_lightning.export.onnx_nodes import NodeBuilder, graph_names

__all__ = ["torch_running_statistics"]

_KERNEL = "BatchNormInternal"
#: ONNX's default momentum of BatchNormalization (torch's 0.1).
_DEFAULT_MOMENTUM = 0.9


def _attribute(node: onnx.NodeProto, name: str, default: float) -> float:
    return next((a.f for a in node.attribute if a.name == name), default)


def _torch_momentum(node: onnx.NodeProto) -> float:
    # NOTE: the exporter stores 1 - momentum as float32 (0.9 -> 0.899999976); torch's value is the
    # short decimal it came from, so the update uses 0.1, not 0.100000024.
    return float(f"{1.0 - _attribute(node, 'momentum', _DEFAULT_MOMENTUM):.6g}")


def _set_kernel_momentum(node: onnx.NodeProto) -> None:
    for attribute in node.attribute:
        if attribute.name == "momentum":
            attribute.f = 1.0
            return
    node.attribute.append(helper.make_attribute("momentum", 1.0))


class _Builder:
    """Appends the nodes of one BatchNorm's update under a common name prefix."""

    def __init__(self, prefix: str, nodes: NodeBuilder) -> None:
        self.prefix = prefix
        self._nodes = nodes
        self.nodes: list[onnx.NodeProto] = []

    def constant(self, name: str, value: float | bool) -> str:
        array = np.array([value], dtype=np.bool_) if isinstance(value, bool) else np.array(value, dtype=np.float32)
        self.nodes.append(self._nodes.constant(array, scope=f"{self.prefix}/{name}"))
        return self.nodes[-1].output[0]

    def op(self, op_type: str, inputs: list[str], name: str, **attributes: Any) -> str:
        self.nodes.append(self._nodes.node(op_type, inputs, name=f"{self.prefix}/{name}", **attributes))
        return self.nodes[-1].output[0]

    def blend(self, running: str, batch: str, keep: str, take: str, name: str) -> str:
        """``running * keep + batch * take``."""
        kept = self.op("Mul", [running, keep], f"{name}_kept")
        taken = self.op("Mul", [batch, take], f"{name}_taken")
        return self.op("Add", [kept, taken], name)

    def write(self, buffer: str, value: str, overwrite: str, name: str) -> None:
        self.nodes.append(
            self._nodes.node(
                "InPlaceAccumulatorV2", [buffer, value, overwrite], name=f"{self.prefix}/{name}_write",
                domain="com.microsoft",
            )
        )


def _unbiased_variance(build: _Builder, node: onnx.NodeProto) -> str:
    """The batch's unbiased variance per channel, from the kernel's saved inverse std."""
    x, running_var, inv_std = node.input[0], node.input[4], node.output[4]
    one = build.constant("one", 1.0)
    eps = build.constant("eps", _attribute(node, "epsilon", 1e-5))
    count = build.op("Div", [build.op("Size", [x], "x_size"), build.op("Size", [running_var], "channels")], "n_int")
    n = build.op("Cast", [count], "n", to=TensorProto.FLOAT)
    # NOTE: n == 1 has no unbiased variance (torch refuses it); the guard keeps the update finite.
    bessel = build.op("Div", [n, build.op("Max", [build.op("Sub", [n, one], "n_minus_1"), one], "dof")], "bessel")
    variance = build.op("Sub", [build.op("Reciprocal", [build.op("Mul", [inv_std, inv_std], "inv_var")], "var_eps"),
                                eps], "var_biased")
    return build.op("Mul", [variance, bessel], "var_unbiased")


def _rewrite_node(node: onnx.NodeProto, state: set[str], names: NodeBuilder) -> list[onnx.NodeProto]:
    running_mean, running_var = node.input[3], node.input[4]
    if running_mean not in state or running_var not in state or len(node.output) < 5:
        return []
    momentum = _torch_momentum(node)
    _set_kernel_momentum(node)
    build = _Builder(f"{node.name or running_var}/torch_running_statistics", names)
    keep, take = build.constant("keep", 1.0 - momentum), build.constant("take", momentum)
    overwrite = build.constant("overwrite", True)
    new_mean = build.blend(running_mean, node.output[3], keep, take, "running_mean")
    new_var = build.blend(running_var, _unbiased_variance(build, node), keep, take, "running_var")
    build.write(running_mean, new_mean, overwrite, "running_mean")
    build.write(running_var, new_var, overwrite, "running_var")
    return build.nodes


def torch_running_statistics(proto: onnx.ModelProto) -> int:
    """Rewrite, in place, a training graph's BatchNorm updates (those of checkpoint state) to torch's rule."""
    state = {info.name for info in proto.graph.input}
    names = NodeBuilder(graph_names(proto.graph))
    added: list[onnx.NodeProto] = []
    rewritten = 0
    for node in proto.graph.node:
        if node.op_type == _KERNEL:
            nodes = _rewrite_node(node, state, names)
            rewritten += bool(nodes)
            added.extend(nodes)
    proto.graph.node.extend(added)
    return rewritten
