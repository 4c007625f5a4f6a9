"""Flower's own SecAggPlusWorkflow completes a round with JavaScript SecAgg+ devices, one of which drops.

Four JavaScript clients (``tests/web/secagg_devices.mjs``, one Node process) answer Flower's
``SecAggPlusWorkflow`` (under ``LegacyContext`` and FedAvg, as Flower 1.42 requires) through a
Grid that carries each message to its device; one device stops answering after sharing its keys,
so Flower rebuilds its private key from the others' Shamir shares and removes its pairwise masks.
The round's aggregate is the weighted average of the three updates that arrived, within the
quantization step that Flower's parameters imply.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.common import Code, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays  # noqa: E402
from flwr.compat.common import recorddict_compat as compat  # noqa: E402
from flwr.server import Grid, LegacyContext, ServerConfig  # noqa: E402
from flwr.server.client_manager import SimpleClientManager  # noqa: E402
from flwr.server.compat.grid_client_proxy import GridClientProxy  # noqa: E402
from flwr.server.strategy import FedAvg  # noqa: E402
from flwr.server.workflow import SecAggPlusWorkflow  # noqa: E402
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from tests._web import ROOT  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("node") is None, reason="node (Node.js 20) is not installed: "
                                 "the JavaScript SecAgg+ client runs in Node here (.ci/run installs it)")]

NODES = [2**62 + 11, 2**40 + 3, 17, 2**53 + 1]
DROPPED = NODES[2]  # answers setup and share keys, then no more
SHAPES = [(30,), (2, 3)]
CLIPPING, TARGET = 8.0, 2**22


def _update(nid: int) -> tuple[list[np.ndarray], int]:
    rng = np.random.default_rng(nid % 1009)
    return [rng.normal(0, 0.3, size=shape).astype(np.float32) for shape in SHAPES], 10 + nid % 50


def _tag(value: Any) -> Any:
    if isinstance(value, list):
        return [_tag(v) for v in value]
    if isinstance(value, bytes):
        return {"b": base64.b64encode(value).decode()}
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError(f"no tag for {value!r}")
    return {"i": str(value)} if isinstance(value, int) else {"f": value} if isinstance(value, float) else {"s": value}


def _untag(value: Any) -> Any:
    if isinstance(value, list):
        return [_untag(v) for v in value]
    return base64.b64decode(value["b"]) if "b" in value else int(value["i"])


class NodeDevices(Grid):
    """Flower's Grid over the JavaScript devices: each message goes to its device, each reply comes back."""

    def __init__(self) -> None:
        self._node = subprocess.Popen([str(shutil.which("node")), "tests/web/secagg_devices.mjs"], cwd=ROOT,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stages: list[str] = []

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for message in messages:
            configs = message.content.config_records["secaggplus_configs"]
            stage, nid = str(configs["stage"]), message.metadata.dst_node_id
            self.stages.append(stage)
            if nid == DROPPED and stage not in ("setup", "share_keys"):
                continue
            request = {"node": str(nid), "stage": stage, "configs": [[k, _tag(v)] for k, v in configs.items()]}
            if stage == "collect_masked_vectors":
                arrays, count = _update(nid)
                request["fit"] = {"num_examples": count,
                                  "arrays": [{"values": a.flatten().tolist(), "shape": list(a.shape)} for a in arrays]}
            replies.append(Message(self._content(stage, self._ask(request), nid), reply_to=message))
        return replies

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._node.stdin is not None
        assert self._node.stdout is not None
        self._node.stdin.write(json.dumps(request) + "\n")
        self._node.stdin.flush()
        line = self._node.stdout.readline()
        if not line:
            error = self._node.stderr.read() if self._node.stderr else ""
            raise RuntimeError(f"the JavaScript device stopped: {error}")
        return {key: _untag(value) for key, value in json.loads(line)}

    @staticmethod
    def _content(stage: str, reply: dict[str, Any], nid: int) -> RecordDict:
        content = RecordDict()
        if stage == "collect_masked_vectors":  # the legacy fit reply the mod leaves, its arrays cleared
            fitres = FitRes(Status(Code.OK, ""), Parameters([], "numpy.ndarray"), _update(nid)[1], {})
            content = compat.fitres_to_recorddict(fitres, keep_input=True)
        content.config_records["secaggplus_configs"] = ConfigRecord(reply)
        return content

    def close(self) -> None:
        if self._node.stdin is not None:
            self._node.stdin.close()
        self._node.wait(timeout=30)

    # The workflow only sends and receives; the rest of the Grid is the deployment's.
    def _unused(self, *_: Any, **__: Any) -> Any:
        raise NotImplementedError("the JavaScript devices' Grid only sends and receives")

    set_run = get_node_ids = push_messages = pull_messages = create_message = _unused
    run = property(_unused)


def test_flowers_workflow_aggregates_javascript_devices_one_of_which_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    # A ServerApp's identity, as Flower's own run sets it, for the messages the workflow makes.
    for name, value in (("_task_id", 1), ("_run_id", 1), ("_node_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)
    grid = NodeDevices()
    manager = SimpleClientManager()
    for nid in NODES:
        manager.register(GridClientProxy(nid, grid, run_id=1))
    context = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=1), client_manager=manager,
                            strategy=FedAvg(fraction_fit=1.0, min_fit_clients=4, min_available_clients=4))
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({"current_round": 1})
    start = ndarrays_to_parameters([np.zeros(shape, np.float32) for shape in SHAPES])
    context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(start, keep_input=True)
    try:
        SecAggPlusWorkflow(num_shares=3, reconstruction_threshold=2, clipping_range=CLIPPING,
                           quantization_range=TARGET, timeout=60)(grid, context)
    finally:
        grid.close()
    assert grid.stages.count("unmask") == len(NODES) - 1, grid.stages

    aggregate = parameters_to_ndarrays(compat.arrayrecord_to_parameters(
        context.state.array_records[MAIN_PARAMS_RECORD], keep_input=True))
    arrived = [_update(nid) for nid in NODES if nid != DROPPED]
    ratios = [round(count / 1000.0 * TARGET) / TARGET for _, count in arrived]
    expected = [sum(r * arrays[i].astype(np.float64) for r, (arrays, _) in zip(ratios, arrived, strict=True))
                / sum(ratios) for i in range(len(SHAPES))]
    # Each device's stochastic rounding is off by under one step (2 * clipping / target) before the division.
    bound = len(arrived) * (2 * CLIPPING / TARGET) / sum(ratios)
    for got, want in zip(aggregate, expected, strict=True):
        assert got.shape == want.shape
        assert np.max(np.abs(got - want)) <= bound, (np.max(np.abs(got - want)), bound)
        assert np.max(np.abs(got - want)) > 0  # the aggregate went through quantization, not around it
