"""Each legalization rewrite alone: a one-layer torch model, one real ORT training step, torch autograd as reference.

Exported at batch 4 and trained at batch 6, so every rewrite is also checked under a dynamic batch.
Forward outputs must match torch within 1e-6 and every gradient within 1e-5 relative: stricter than
export verification, which these exports skip (``verify=False``; tests/export/test_verify.py tests it).
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from ort_lightning import export_artifacts
from ort_lightning.errors import ExportError
from ort_lightning.export.legalize.engine import RULES, legalize
from tools._step import compare_step

FORWARD_TOLERANCE = 1e-6
GRADIENT_TOLERANCE = 1e-5


def _randn(*shape: int, scale: float = 3.0) -> Callable[[int], tuple[torch.Tensor, ...]]:
    return lambda batch: (torch.randn(batch, *shape, generator=torch.Generator().manual_seed(batch)) * scale,)


def _tokens(batch: int) -> tuple[torch.Tensor, ...]:
    tokens = torch.randint(0, 6, (batch, 5), generator=torch.Generator().manual_seed(batch))
    tokens[:, -1] = 0  # every sequence ends in padding
    return (tokens,)


class _Flip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return h.flip(1) * h.cumsum(1) + h.amax(1, keepdim=True) - h.amin(1, keepdim=True) + h.norm(dim=1, keepdim=True)


class _Gathers(nn.Module):
    """Every Gather form the Gather rule rewrites: a lookup, scalar and run indices, a non-run index, axis 0."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.linear = nn.Linear(4, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.linear(self.embed(tokens))  # (batch, 5, 4)
        picked = h[:, 0] + h[:, -1] + h[:, 1:3].sum(1) + h[:, [3, 1]].sum(1)  # Slice, Slice, Slice, Gather axis 1
        rows = h.transpose(0, 1)[torch.tensor([4, 2, 2])].sum(0)  # GatherND along axis 0 of an activation
        return picked * rows


class _InitialState(nn.Module):
    """Two LSTM (or GRU) layers from learned initial states; the output and the last states all count."""

    def __init__(self, cell: type[nn.LSTM] | type[nn.GRU]) -> None:
        super().__init__()
        self.rnn = cell(4, 5, num_layers=2, batch_first=True)
        self.h0 = nn.Parameter(torch.randn(2, 1, 5))
        self.c0 = nn.Parameter(torch.randn(2, 1, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        h0, c0 = (s.expand(-1, batch, -1).contiguous() for s in (self.h0, self.c0))
        if isinstance(self.rnn, nn.GRU):
            out, h = self.rnn(x, h0)
            return out + h[-1].unsqueeze(1)
        out, (h, c) = self.rnn(x, (h0, c0))
        return out + h[-1].unsqueeze(1) + c[-1].unsqueeze(1)


class _Einsum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bij,jkl->bkil", x, self.weight).flatten(1) + torch.einsum("bij->bj", x).sum(1, True)


class _SameTypeCast(nn.Module):
    """``.to(float32)`` of a float32 tensor (peft's LoRA output), whose output feeds one Mul twice (``h * h``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x).to(torch.float32)
        return h * h


def _lstm_last(bidirectional: bool, cell: Callable[..., nn.Module]) -> nn.Module:
    class Last(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = cell(4, 5, batch_first=True, bidirectional=bidirectional)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.rnn(x)[0]

    return Last()


#: One model per rewrite of the RULES table: (id, the ONNX ops it must remove, model factory, inputs).
REWRITES = [
    ("layer-norm", [], lambda: nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8)), _randn(6)),
    ("relu", ["Relu"], lambda: nn.Sequential(nn.Conv1d(3, 4, 1), nn.ReLU()), _randn(3, 6)),
    ("hardswish", ["HardSwish"], lambda: nn.Sequential(nn.Linear(6, 8), nn.Hardswish()), _randn(6)),
    ("hardsigmoid", ["HardSigmoid"], lambda: nn.Sequential(nn.Linear(6, 8), nn.Hardsigmoid()), _randn(6)),
    ("elu", ["Elu"], lambda: nn.Sequential(nn.Linear(6, 8), nn.ELU(0.7)), _randn(6)),
    ("selu", ["Selu"], lambda: nn.Sequential(nn.Linear(6, 8), nn.SELU()), _randn(6)),
    ("celu", ["Celu"], lambda: nn.Sequential(nn.Linear(6, 8), nn.CELU(1.5)), _randn(6)),
    ("softplus-mish", ["Softplus"], lambda: nn.Sequential(nn.Linear(6, 8), nn.Mish(), nn.Softplus()), _randn(6)),
    ("prelu", ["PRelu"], lambda: nn.Sequential(nn.Linear(6, 8), nn.PReLU(8, 0.3)), _randn(6)),
    ("sign-lppool", ["Sign"], lambda: nn.Sequential(nn.Conv1d(3, 3, 1), nn.LPPool1d(2, 2)), _randn(3, 6)),
    ("group-norm", ["InstanceNormalization"], lambda: nn.Sequential(nn.Conv1d(3, 6, 1), nn.GroupNorm(3, 6)),
     _randn(3, 7)),
    # ORT cannot infer GroupNorm's output shape (a Reshape to a computed shape); MaxPool's gradient needs it.
    ("group-norm-then-maxpool", ["InstanceNormalization"],
     lambda: nn.Sequential(nn.Conv2d(2, 8, 1), nn.GroupNorm(2, 8), nn.ReLU(), nn.MaxPool2d(2)), _randn(2, 4, 4)),
    ("instance-norm", ["InstanceNormalization"],
     lambda: nn.Sequential(nn.Linear(5, 5), nn.InstanceNorm1d(4, affine=True)), _randn(4, 5)),
    ("avgpool", ["AveragePool"], lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.AvgPool2d(2)), _randn(2, 6, 6)),
    ("avgpool-pad-ceil", ["AveragePool"],
     lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)),
     _randn(2, 6, 6)),
    ("avgpool-count-pad-3d", ["AveragePool"],
     lambda: nn.Sequential(nn.Conv3d(2, 3, 1), nn.AvgPool3d(3, 2, 1, ceil_mode=True)), _randn(2, 5, 5, 5)),
    ("adaptive-avgpool", ["AveragePool"], lambda: nn.Sequential(nn.Conv1d(2, 3, 1), nn.AdaptiveAvgPool1d(3)),
     _randn(2, 6)),
    ("upsample-bilinear", ["Resize"],
     lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.Upsample(scale_factor=2, mode="bilinear")), _randn(2, 3, 4)),
    ("upsample-nearest-3d", ["Resize"], lambda: nn.Sequential(nn.Conv3d(2, 3, 1), nn.Upsample(scale_factor=2)),
     _randn(2, 2, 3, 2)),
    ("pixel-shuffle", ["DepthToSpace"], lambda: nn.Sequential(nn.Conv2d(2, 8, 1), nn.PixelShuffle(2)),
     _randn(2, 3, 3)),
    ("flip-cumsum-max-min-norm", ["CumSum", "ReduceMax", "ReduceMin", "ReduceL2"], _Flip, _randn(4)),
    ("reflection-pad", ["Pad"], lambda: nn.Sequential(nn.Conv2d(2, 3, 1), nn.ReflectionPad2d((1, 2, 2, 1))),
     _randn(2, 4, 4)),
    ("replication-pad", ["Pad"], lambda: nn.Sequential(nn.Conv1d(2, 3, 1), nn.ReplicationPad1d(2)), _randn(2, 4)),
    ("conv-transpose", ["ConvTranspose"], lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1,
                                                                    groups=2, dilation=2), _randn(4, 4, 3)),
    ("lstm", ["LSTM"], lambda: _lstm_last(False, nn.LSTM), _randn(3, 4)),
    ("bidirectional-lstm", ["LSTM"], lambda: _lstm_last(True, nn.LSTM), _randn(3, 4)),
    ("lstm-2layer-initial-state", ["LSTM"], lambda: _InitialState(nn.LSTM), _randn(3, 4)),
    ("gru", ["GRU"], lambda: _lstm_last(False, nn.GRU), _randn(3, 4)),
    ("gru-2layer-initial-state", ["GRU"], lambda: _InitialState(nn.GRU), _randn(3, 4)),
    ("gru-lstm-without-bias", ["GRU", "LSTM"], lambda: nn.Sequential(
        _lstm_last(False, lambda *a, **k: nn.GRU(*a, bias=False, **k)), nn.Linear(5, 4),
        _lstm_last(True, lambda *a, **k: nn.LSTM(*a, bias=False, **k))), _randn(3, 4)),
    ("bidirectional-gru", ["GRU"], lambda: _lstm_last(True, nn.GRU), _randn(3, 4)),
    ("embedding-padding-idx", [], lambda: nn.Embedding(6, 3, padding_idx=0), _tokens),
    ("gathers", [], _Gathers, _tokens),
    ("rnn-bidirectional-2layer", ["RNN"],
     lambda: _lstm_last(True, lambda *a, **k: nn.RNN(*a, num_layers=2, nonlinearity="relu", **k)), _randn(3, 4)),
    ("einsum", ["Einsum"], lambda: _Einsum(), _randn(2, 3)),
    ("same-type-cast", ["Cast"], _SameTypeCast, _randn(6)),
]


@pytest.mark.parametrize(("name", "ops", "build", "inputs"), REWRITES, ids=[r[0] for r in REWRITES])
def test_rewrite_matches_torch(
    tmp_path: Path, name: str, ops: list[str], build: Callable[[], nn.Module], inputs: Callable[[int], tuple]
) -> None:
    torch.manual_seed(0)
    result = compare_step(build(), inputs(4), inputs(6), folder=tmp_path / name, verify=False)
    assert result.output_rel <= FORWARD_TOLERANCE, result
    assert result.grad_rel <= GRADIENT_TOLERANCE, result
    # NOTE: ORT's own gradient nodes (named ``.../X_Grad/...``) may use these ops; the forward must not.
    graph = onnx.load(tmp_path / name / "training_model.onnx").graph
    remaining = {node.op_type for node in graph.node if "_Grad/" not in node.name}
    assert not remaining & set(ops), f"{sorted(remaining & set(ops))} left in the forward of the training graph"


def test_no_gather_gradient_locks_per_element(tmp_path: Path) -> None:
    """ORT's CPU GatherGrad locks a mutex per element (most of a BERT-tiny step): embeddings,
    MultiheadAttention's q/k/v split and flips must reach ORT as GatherND and Slice, whose gradients do not."""

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.layer(self.embed(tokens))[:, 0].flip(-1)  # flip: a Gather along the last axis

    export_artifacts(Encoder(), torch.zeros(2, 5, dtype=torch.long), tmp_path, loss="mse", verify=False)
    ops = [node.op_type for node in onnx.load(tmp_path / "training_model.onnx").graph.node]
    assert "GatherGrad" not in ops
    assert "GatherNDGrad" in ops


def test_layer_norm_gets_the_outputs_ort_gradient_reads(tmp_path: Path) -> None:
    export_artifacts(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)), torch.zeros(2, 3), tmp_path, loss="mse",
                     verify=False)
    graph = onnx.load(tmp_path / "training_model.onnx").graph
    assert [len(n.output) for n in graph.node if n.op_type == "LayerNormalization"] == [3]


def test_every_rule_has_a_reason_and_a_test() -> None:
    covered = {op for _, ops, _, _ in REWRITES for op in ops}
    covered |= {"LayerNormalization", "Slice", "LSTM", "GRU", "Gather", "Pad", "If", "Loop", "Scan"}
    assert set(RULES) <= covered, sorted(set(RULES) - covered)
    assert all(rule.reason for rule in RULES.values())


def _layer_norm_onnx(path: Path) -> nn.Module:
    """A LayerNorm model written to an ONNX file by torch itself (one output, as torch writes it)."""
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Hardswish())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(model), (torch.zeros(4, 6),), str(path), dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["logits"], dynamic_axes={"input": {0: "batch"}},
                          do_constant_folding=False)
    return model


@pytest.mark.parametrize("as_proto", [False, True], ids=["onnx-file", "model-proto"])
def test_onnx_sources_are_legalized_too(tmp_path: Path, as_proto: bool) -> None:
    torch.manual_seed(0)
    model = _layer_norm_onnx(tmp_path / "model.onnx")
    source = onnx.load(tmp_path / "model.onnx") if as_proto else tmp_path / "model.onnx"
    written = onnx.load(tmp_path / "model.onnx").graph.node
    assert [len(n.output) for n in written if n.op_type == "LayerNormalization"] == [1]
    inputs = _randn(6)
    result = compare_step(model, inputs(4), inputs(6), source=source, verify=False)
    assert result.output_rel <= FORWARD_TOLERANCE, result
    assert result.grad_rel <= GRADIENT_TOLERANCE, result


def test_a_declined_rewrite_says_why_at_debug_level(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(nn.Linear(6, 8), nn.ConstantPad1d(1, 0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(4, 6),), str(tmp_path / "pad.onnx"), dynamo=False, opset_version=17)
    proto = onnx.load(tmp_path / "pad.onnx")
    said = "rule Pad declined node '/1/Pad': 'constant' mode: ORT 1.19.2 differentiates it"
    with caplog.at_level(logging.INFO, logger="ort_lightning"):
        legalize(copy.deepcopy(proto))
    assert said not in caplog.text
    with caplog.at_level(logging.DEBUG, logger="ort_lightning"):
        legalize(proto)
    assert said in caplog.text


def _custom_op_model() -> onnx.ModelProto:
    weight = numpy_helper.from_array(np.ones((4, 3), np.float32), "head.weight")
    nodes = [
        helper.make_node("MatMul", ["input", "head.weight"], ["h"], name="/head/MatMul"),
        helper.make_node("Swish", ["h"], ["logits"], name="/blocks.0/act/Swish", domain="com.example"),
    ]
    graph = helper.make_graph(
        nodes, "custom", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    model.ir_version = 10
    return model


def test_an_op_without_gradient_or_rewrite_names_op_node_and_module(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"can differentiate the ONNX op 'Swish' \(domain 'com.example'\) at node "
                       r"'/blocks.0/act/Swish' \(torch module 'blocks.0.act'\).*no rewrite.*docs/ops.md"):
        export_artifacts(_custom_op_model(), None, tmp_path / "custom", loss="mse")


class _Squash(nn.Module):
    """arctan: ONNX Atan has no gradient in ORT 1.19.2 and no exact rewrite into ops that have one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.atan(x)


def test_a_torch_layer_without_gradient_names_its_module(tmp_path: Path) -> None:
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(4, 5))
    model.add_module("squash", _Squash())
    with pytest.raises(ExportError, match=r"no gradient for the ONNX op 'Atan' \(domain 'ai.onnx'\) at node "
                       r"'/squash/Atan' \(torch module 'squash'\).*no rewrite.*replace that layer"):
        export_artifacts(model, torch.zeros(2, 4), tmp_path / "atan", loss="mse")


def test_control_flow_on_the_gradient_path_is_refused_before_ort_aborts(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.LocalResponseNorm(2))
    with pytest.raises(ExportError, match=r"'If' .* at node '/1/If' \(torch module '1'\) is control flow on the "
                       r"gradient path.*aborts the process"):
        export_artifacts(model, torch.zeros(2, 3, 4, 4), tmp_path / "lrn", loss="mse")


def test_avgpool_that_cannot_be_rewritten_exactly_is_refused() -> None:
    node = helper.make_node("AveragePool", ["x"], ["y"], name="/pool/AveragePool", kernel_shape=[2, 2], ceil_mode=1)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(ExportError, match=r"AveragePool node '/pool/AveragePool' runs over a dynamic batch.*SIGFPE.*"
                       r"ceil_mode or padding that is not counted needs static spatial sizes"):
        legalize(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_static_batch_keeps_the_native_avgpool() -> None:
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert legalize(proto) == []
    assert [n.op_type for n in proto.graph.node] == ["AveragePool"]


def _single_node_model(node: onnx.NodeProto, inputs: list[onnx.ValueInfoProto],
                       initializers: Sequence[onnx.TensorProto] = ()) -> onnx.ModelProto:
    outputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in node.output if name]
    graph = helper.make_graph([node], "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _float(name: str, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _ones(name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ones(shape, np.float32), name)


def test_reflect_pad_of_unknown_pads_is_refused() -> None:
    node = helper.make_node("Pad", ["x", "pads"], ["y"], name="/pad/Pad", mode="reflect")
    pads = helper.make_tensor_value_info("pads", TensorProto.INT64, [4])
    with pytest.raises(ExportError, match=r"'Pad' .* at node '/pad/Pad' \(torch module 'pad'\) pads in 'reflect' "
                       r"mode.*give the layer fixed sizes"):
        legalize(_single_node_model(node, [_float("x", ["n", 5]), pads]))


def test_conv_transpose_with_output_shape_is_refused() -> None:
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="/up/ConvTranspose", output_shape=[9])
    with pytest.raises(ExportError, match=r"no CPU gradient kernel for the ONNX op 'ConvTranspose' .* cannot be "
                       r"rewritten as a Conv.*use Upsample \+ Conv instead"):
        legalize(_single_node_model(node, [_float("x", ["n", 2, 4])], [_ones("w", 2, 3, 3)]))


def test_bidirectional_lstm_with_sequence_lengths_is_refused() -> None:
    node = helper.make_node("LSTM", ["x", "w", "r", "", "lengths"], ["y"], name="/rnn/LSTM", hidden_size=2,
                            direction="bidirectional")
    lengths = helper.make_tensor_value_info("lengths", TensorProto.INT32, ["n"])
    with pytest.raises(ExportError, match=r"forward direction only, and this bidirectional one cannot be split.*"
                       r"without packed sequences"):
        legalize(_single_node_model(node, [_float("x", [3, "n", 4]), lengths],
                                    [_ones("w", 2, 8, 4), _ones("r", 2, 8, 2)]))


def test_lstm_of_unknown_length_keeps_orts_kernel() -> None:
    node = helper.make_node("LSTM", ["x", "w", "r"], ["y"], name="/rnn/LSTM", hidden_size=2)
    proto = _single_node_model(node, [_float("x", ["t", "n", 4])], [_ones("w", 1, 8, 4), _ones("r", 1, 8, 2)])
    assert legalize(proto) == []
    assert [n.op_type for n in proto.graph.node] == ["LSTM"]


def test_rnn_of_unknown_length_is_refused() -> None:
    node = helper.make_node("RNN", ["x", "w", "r"], ["y"], name="/rnn/RNN", hidden_size=2)
    with pytest.raises(ExportError, match=r"no gradient for the ONNX op 'RNN' .* cannot be unrolled.*export with a "
                       r"fixed sequence length, or use nn.GRU/nn.LSTM"):
        legalize(_single_node_model(node, [_float("x", ["t", "n", 4])], [_ones("w", 1, 2, 4), _ones("r", 1, 2, 2)]))
