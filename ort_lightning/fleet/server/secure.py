"""A fleet's rounds through Flower's own SecAgg+: the server sees the sum of the devices' updates, never one of them.

`SecureFleetServer` runs ``SecAggPlusWorkflow`` inside ``DefaultWorkflow`` under ``LegacyContext``
with Flower's legacy ``FedAvg`` (client-side DP around it where asked), as Flower 1.42 requires, and
keeps what `FleetServer` keeps: a checkpoint per round, the global evaluation, a `RoundRecord` per
round. The devices run `secure_mods` (Flower's ``secaggplus_mod``, `legacy_fit_mod` inside it).
A round whose devices fall below the reconstruction threshold aggregates nothing: its record says
why in `RoundRecord.halted`, its files are not written, and the next round starts from the same values.
A browser grid runs the same workflow: its frames carry the four stages' records (docs/browsers.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

from flwr.app import Context, Message, RecordDict
from flwr.common import FitIns, FitRes, Parameters, Scalar
from flwr.server import LegacyContext, ServerConfig
from flwr.server import strategy as legacy
from flwr.server.client_manager import ClientManager, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.serverapp import Grid, ServerApp
from torch.utils.data import DataLoader

from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.devices.legacy_fit import (
    NAMES_KEY,
    arrays_to_parameters,
    parameters_to_arrays,
    secure_when_asked,
)
from ort_lightning.fleet.devices.protocol import DEVICE_TIMEOUT, WEIGHT_KEY
from ort_lightning.fleet.server.global_model import LAST_NAME, GlobalModel, round_path
from ort_lightning.fleet.server.server_app import RoundRecord, app_running

__all__ = ["SecureFleetServer", "secure_mods"]

_LEGACY_PRIVACY = {"fixed": legacy.DifferentialPrivacyClientSideFixedClipping,
                   "adaptive": legacy.DifferentialPrivacyClientSideAdaptiveClipping}
_STAGES = ("setup", "share keys", "collect masked vectors", "unmask")


def secure_mods() -> list[Any]:
    """A device's client mods for secure aggregation: `secure_when_asked` (Flower's ``secaggplus_mod`` as it is)."""
    return [secure_when_asked]


def _weighted_mean(pairs: list[tuple[int, dict[str, Scalar]]]) -> dict[str, Scalar]:
    """The devices' numeric metrics averaged by example count (the Message API's FedAvg default)."""
    total = sum(count for count, _ in pairs)
    names = {name for _, metrics in pairs for name, value in metrics.items() if isinstance(value, int | float)}
    if not total:
        return {}
    return {name: sum(count * float(cast(float, metrics.get(name, 0.0))) for count, metrics in pairs) / total
            for name in sorted(names - {WEIGHT_KEY})}


class _Stages(SecAggPlusWorkflow):
    """Flower's SecAgg+ stages, one after another as its own ``__call__`` runs them; a halt keeps its reason."""

    halted: str | None = None

    def __call__(self, grid: Grid, context: Context) -> None:
        state = WorkflowState()
        self.halted = None
        steps = (self.setup_stage, self.share_keys_stage, self.collect_masked_vectors_stage, self.unmask_stage)
        sampled = 0
        for name, step in zip(_STAGES, steps, strict=True):
            if not step(grid, cast(LegacyContext, context), state):
                self.halted = _why(name, state, sampled or len(state.sampled_node_ids))
                return
            sampled = sampled or len(state.sampled_node_ids)
            if name == "share keys":
                _forget_unshared(state)


def _forget_unshared(state: WorkflowState) -> None:
    """Leave out of the round the devices whose key shares never went out (they left at setup or share keys).

    Nobody masked with them and nobody holds a share of their keys, so SecAgg+ drops them from the round.
    """
    # NOTE: Flower 1.42 keeps them among the sampled nodes: its unmask stage then asks every device for shares of
    # their keys, which none holds (each fails with a KeyError), and one device that left early loses the round.
    state.sampled_node_ids = state.sampled_node_ids & state.active_node_ids
    for neighbours in state.nid_to_neighbours.values():
        neighbours &= state.active_node_ids


def _why(stage: str, state: WorkflowState, sampled: int) -> str:
    if sampled < 2:
        return f"secure aggregation needs 2 devices or more, but {sampled} were sampled; no aggregate this round"
    return (f"secure aggregation stopped at its {stage} stage: {len(state.active_node_ids)} of {sampled} devices "
            f"still answered, below the reconstruction threshold of {state.threshold} shares; no aggregate this "
            "round, and the next one starts from the same values")


class _Watch(Grid):
    """The workflow's grid, watched: each node's failure and its bytes, in and out, per stage."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.failures: dict[int, str] = {}
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        nodes = {message.metadata.message_id: message.metadata.dst_node_id for message in messages}
        for message in messages:
            node = message.metadata.dst_node_id
            self.sent[node] = self.sent.get(node, 0) + _bytes(message.content)
        answered = set()
        for reply in replies:
            node = nodes.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
            answered.add(node)
            if reply.has_error():
                self.failures.setdefault(node, str(reply.error.reason))
            else:
                self.received[node] = self.received.get(node, 0) + _bytes(reply.content)
        for node in set(nodes.values()) - answered:
            self.failures.setdefault(node, f"no reply within the timeout of {timeout} s")
        return replies

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def set_run(self, run: Any) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Any:
        return self.grid.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def take(self) -> tuple[dict[int, str], int, int]:
        """This round's failures and mean bytes out and back per device; the counts start again."""
        failures, sent, received = self.failures, self.sent, self.received
        self.failures, self.sent, self.received = {}, {}, {}
        out = max(sent.values(), default=0)
        back = sum(received.values()) // len(received) if received else 0
        return failures, out, back


def _bytes(content: RecordDict) -> int:
    """The bytes of a message's arrays and of the byte strings in its configs (keys, shares, masked vectors)."""
    arrays = sum(len(array.data) for record in content.array_records.values() for array in record.values())
    configs = 0
    for record in content.config_records.values():
        for value in record.values():
            items = value if isinstance(value, list) else [value]
            configs += sum(len(item) for item in items if isinstance(item, bytes))
    return arrays + configs


class _Rounds(legacy.Strategy):
    """The legacy strategy the workflow drives: `inner` (FedAvg) samples and averages; this keeps the rounds."""

    def __init__(self, inner: legacy.Strategy, server: SecureFleetServer) -> None:
        self.inner = inner
        self.server = server
        self.names: list[str] = []
        self.answers: dict[int, tuple[int, int, dict[str, Scalar]]] = {}
        self.written: dict[int, Path] = {}
        self.seconds: dict[int, tuple[float, float]] = {}

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        parameters, self.names = arrays_to_parameters(self.server.model.arrays())
        return parameters

    def configure_fit(self, server_round: int, parameters: Parameters,
                      client_manager: ClientManager) -> list[tuple[ClientProxy, FitIns]]:
        instructions = self.inner.configure_fit(server_round, parameters, client_manager)
        for _, fitins in instructions:
            fitins.config.update({**self.server.train_config, NAMES_KEY: "\n".join(self.names)})
        return instructions

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[tuple[ClientProxy, FitRes] | BaseException]) -> tuple[Parameters | None,
                                                                                              dict[str, Scalar]]:
        number = server_round + self.server.round_offset
        started = time.perf_counter()
        parameters, metrics = self.inner.aggregate_fit(server_round, results, failures)
        aggregated = time.perf_counter()
        self.answers[number] = (len(results), sum(fitres.num_examples for _, fitres in results), metrics)
        if parameters is not None:
            model = self.server.model
            model.load(parameters_to_arrays(parameters, self.names), server_round=number)
            self.written[number] = model.save(round_path(self.server.directory, number))
            model.save(self.server.directory / LAST_NAME)
            # NOTE: SecAgg+ dequantizes to float64; the next round sends the model's float32 values, as saved.
            parameters, _ = arrays_to_parameters(model.arrays())
        self.seconds[number] = (aggregated - started, time.perf_counter() - aggregated)
        return parameters, metrics

    def configure_evaluate(self, server_round: int, parameters: Parameters,
                           client_manager: ClientManager) -> list[Any]:
        return []  # the server evaluates the global values on its own test data

    def aggregate_evaluate(self, server_round: int, results: list[Any],
                           failures: list[Any]) -> tuple[float | None, dict[str, Scalar]]:
        return None, {}

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """After each round (0: the start): the global evaluation, and the round's record."""
        return self.server.after_round(server_round, parameters_to_arrays(parameters, self.names))


class SecureFleetServer:
    """Run `rounds` rounds of FedAvg through Flower's SecAgg+ from `model`; checkpoint each round into `directory`.

    Args:
        model: the global values to start from (and to checkpoint and evaluate).
        rounds: rounds to run.
        directory: where the round checkpoints go.
        devices: the fleet's devices (each round samples them all).
        secagg: ``SecAggPlusWorkflow``'s keyword arguments (`SecAggSection.workflow`).
        privacy: None, or the privacy section with ``side: client`` (Flower's legacy client-side DP wrapper).
        test: held-out batches to evaluate the global values on after each round (and before the first).
        train_config: values sent to the devices with every fit instruction.
        min_nodes: devices a round waits for (None: all of them).
        device_timeout: seconds a stage waits for the devices' replies when `secagg` names no timeout.
    """

    def __init__(
        self, model: GlobalModel, *, rounds: int, directory: str | os.PathLike[str], devices: int,
        secagg: Mapping[str, Any], privacy: Mapping[str, Any] | None = None, test: DataLoader | None = None,
        train_config: dict[str, int | float | str] | None = None, min_nodes: int | None = None,
        device_timeout: float | None = DEVICE_TIMEOUT,
    ) -> None:
        if rounds < 1:
            raise ValueError(f"Expected `rounds` >= 1, but got {rounds}; pass the number of federated rounds.")
        self.model = model
        self.rounds = rounds
        self.directory = Path(directory)
        self.test = test
        self.train_config = dict(train_config or {})
        self.round_offset = model.server_round
        self.history: list[RoundRecord] = []
        self.initial: dict[str, Any] = {}
        options = dict(secagg)
        if options.get("timeout") is None:
            options["timeout"] = device_timeout
        try:
            self.workflow = _Stages(**options)
        except (TypeError, ValueError) as error:
            raise ConfigurationError(f"Flower's SecAggPlusWorkflow refused the secagg section: {error} Fix it in the "
                                     "config.") from error
        floor = devices if min_nodes is None else min_nodes
        inner: legacy.Strategy = legacy.FedAvg(
            fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=floor, min_available_clients=floor,
            fit_metrics_aggregation_fn=_weighted_mean)
        if privacy is not None:
            inner = _private(inner, privacy, devices)
        self.strategy = _Rounds(inner, self)
        self._grid: _Watch | None = None
        self._clock = 0.0

    def server_app(self) -> ServerApp:
        """A Flower ``ServerApp`` whose main runs the rounds (``run_local`` or Flower's simulation runs it)."""
        return app_running(self.main)

    def main(self, grid: Grid, context: Context) -> None:
        """Flower's ``DefaultWorkflow`` with ``SecAggPlusWorkflow`` as its fit, over `grid`, recording each round."""
        self._grid = _Watch(grid)
        legacy_context = LegacyContext(context, config=ServerConfig(num_rounds=self.rounds), strategy=self.strategy,
                                       client_manager=SimpleClientManager())
        self._clock = time.perf_counter()
        DefaultWorkflow(fit_workflow=self.workflow)(self._grid, legacy_context)

    def after_round(self, server_round: int, arrays: Any) -> tuple[float, dict[str, Scalar]] | None:
        """The global evaluation of round `server_round` (0: the start), and its `RoundRecord`."""
        evaluation: dict[str, Any] = {}
        if self.test is not None:
            evaluation = dict(self.model.evaluate_fn(self.test)(server_round, arrays))
        now = time.perf_counter()
        if server_round == 0:
            self.initial = evaluation
        else:
            self.history.append(self._record(server_round + self.round_offset, now - self._clock, evaluation))
        self._clock = now
        return (float(evaluation["loss"]), evaluation) if evaluation else None

    def _record(self, number: int, seconds: float, evaluation: dict[str, Any]) -> RoundRecord:
        rounds = self.strategy
        devices, examples, metrics = rounds.answers.get(number, (0, 0, {}))
        failures, sent, received = self._grid.take() if self._grid is not None else ({}, 0, 0)
        aggregate, save = rounds.seconds.get(number, (0.0, 0.0))
        return RoundRecord(number, seconds, evaluation, train_metrics=dict(metrics),
                           checkpoint=rounds.written.get(number), devices=devices, examples=examples,
                           aggregate_seconds=aggregate, checkpoint_seconds=save, failures=failures,
                           sent_bytes=sent, received_bytes=received, halted=self.workflow.halted)


def _private(inner: legacy.Strategy, privacy: Mapping[str, Any], devices: int) -> legacy.Strategy:
    """`inner` in Flower's legacy client-side DP wrapper that the privacy section names."""
    values = dict(privacy)
    values.pop("side", None)
    kind = _LEGACY_PRIVACY[values.pop("clipping", "fixed")]
    values.setdefault("num_sampled_clients", devices)
    try:
        return cast(legacy.Strategy, kind(inner, **values))
    except TypeError as error:
        raise ConfigurationError(f"Flower's {kind.__name__} refused the privacy section: {error} Fix it in the "
                                 "config.") from error
