"""The one place where a fleet's records meet Flower's legacy fit records, which SecAgg+ still speaks.

Flower 1.42's ``SecAggPlusWorkflow`` runs under ``LegacyContext`` and its client mod reads a legacy
``FitRes`` (``fitres.parameters``), whereas `DeviceClient` takes and replies an ``ArrayRecord`` under
``"arrays"`` and a ``MetricRecord`` under ``"metrics"``. Legacy ``Parameters`` carry no names, so the
server sends them in the fit config under `NAMES_KEY`. `legacy_fit_mod` goes inside Flower's
``secaggplus_mod``: it converts the instruction in, the reply out, and clips in between where asked.
`secure_when_asked` runs the two on the messages of a SecAgg+ round and passes the others.
A browser device runs the stages itself: `stage_of` tells a stage's message, `stage_reply` and
`masked_reply` make its checked answer Flower's records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitRes, Parameters, Status, bytes_to_ndarray
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat

from ort_lightning.errors import ConfigurationError, DeviceReplyError
from ort_lightning.fleet.devices.clipping import clip_when_asked
from ort_lightning.fleet.devices.protocol import ARRAYS_KEY, METRICS_KEY, WEIGHT_KEY

__all__ = ["NAMES_KEY", "arrays_to_parameters", "fit_reply", "fit_request", "legacy_fit_mod", "masked_reply",
           "parameters_to_arrays", "secure_when_asked", "stage_of", "stage_reply"]

#: The fit config's key holding the names of the legacy parameters, in their order.
NAMES_KEY = "ort-lightning.names"
_FITINS = "fitins.parameters"
_TENSOR_TYPE = "numpy.ndarray"
#: What a device answers at each SecAgg+ stage: each key of its record and the kind of value (Flower's Key names).
_ANSWERS: dict[str, dict[str, tuple[type, bool]]] = {
    Stage.SETUP: {Key.PUBLIC_KEY_1: (bytes, False), Key.PUBLIC_KEY_2: (bytes, False)},
    Stage.SHARE_KEYS: {Key.DESTINATION_LIST: (int, True), Key.CIPHERTEXT_LIST: (bytes, True)},
    Stage.COLLECT_MASKED_VECTORS: {Key.MASKED_PARAMETERS: (bytes, True)},
    Stage.UNMASK: {Key.NODE_ID_LIST: (int, True), Key.SHARE_LIST: (bytes, True)},
}


def arrays_to_parameters(record: ArrayRecord) -> tuple[Parameters, list[str]]:
    """The record's arrays as legacy ``Parameters`` (their ``.npy`` bytes as they are), and their names in order."""
    return Parameters([record[name].data for name in record], _TENSOR_TYPE), list(record)


def parameters_to_arrays(parameters: Parameters, names: Sequence[str]) -> ArrayRecord:
    """Legacy ``Parameters`` (``.npy`` bytes) as an ``ArrayRecord`` under `names`.

    Raises:
        ConfigurationError: when the names and the tensors differ in number.
    """
    if len(names) != len(parameters.tensors):
        raise ConfigurationError(
            f"Expected one name per legacy tensor, but got {len(names)} names for {len(parameters.tensors)} tensors; "
            f"the server sends the names under `{NAMES_KEY}` of the fit config."
        )
    return ArrayRecord({name: Array.from_numpy_ndarray(_ndarray(data)) for name, data in
                        zip(names, parameters.tensors, strict=True)})


def _ndarray(data: bytes) -> Any:
    return bytes_to_ndarray(data)


def fit_request(content: RecordDict) -> RecordDict:
    """A legacy fit instruction (``fitins.parameters`` and ``fitins.config``) as `DeviceClient` takes it."""
    fitins = compat.recorddict_to_fitins(content, keep_input=True)
    config = dict(fitins.config)
    names = str(config.pop(NAMES_KEY, "")).split("\n") if NAMES_KEY in config else []
    return RecordDict({ARRAYS_KEY: parameters_to_arrays(fitins.parameters, names),
                       "config": ConfigRecord(cast(dict[str, Any], config))})


def fit_reply(content: RecordDict) -> RecordDict:
    """`DeviceClient`'s train reply (``"arrays"``, ``"metrics"``) as a legacy ``FitRes`` record, weighed by count."""
    metrics = dict(content.metric_records[METRICS_KEY])
    parameters, _ = arrays_to_parameters(content.array_records[ARRAYS_KEY])
    fitres = FitRes(Status(Code.OK, ""), parameters, int(cast(float, metrics[WEIGHT_KEY])), metrics)  # type: ignore[arg-type]
    return compat.fitres_to_recorddict(fitres, keep_input=True)


def legacy_fit_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Convert a legacy fit instruction in and `DeviceClient`'s reply out (clipping where asked); pass the rest."""
    if message.metadata.message_type != MessageType.TRAIN or _FITINS not in message.content.array_records:
        return call_next(message, context)
    message.content = fit_request(message.content)
    reply = clip_when_asked(message, context, call_next)
    if reply.has_error():
        return reply
    reply.content = fit_reply(reply.content)
    return reply


def secure_when_asked(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``secaggplus_mod`` around `legacy_fit_mod` for a SecAgg+ round's train messages; the rest pass."""
    if message.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in message.content.config_records:
        return call_next(message, context)
    return secaggplus_mod(message, context, lambda inner, state: legacy_fit_mod(inner, state, call_next))


def stage_of(message: Message) -> str | None:
    """The SecAgg+ stage a train message asks for (Flower's ``Stage``), None for a plain round."""
    configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
    return None if configs is None else str(configs.get(Key.STAGE))


def _checked(stage: str, record: dict[str, Any], device: str) -> dict[str, Any]:
    """`record` when it holds exactly what `stage` answers (keys, bytes, integers), else why not."""
    wanted = _ANSWERS[stage]
    if set(record) != set(wanted):
        raise DeviceReplyError(f"{device} answered SecAgg+'s {stage} stage with {sorted(record)}, but "
                               f"{sorted(wanted)} were expected; the device is refused (use the fleet's page).")
    for key, (kind, many) in wanted.items():
        values = record[key] if many else [record[key]]
        if (many and not isinstance(record[key], list)) or not all(type(v) is kind for v in values):
            raise DeviceReplyError(f"{device} sent {key} of SecAgg+'s {stage} stage as {str(record[key])[:60]}, "
                                   f"but {'a list of ' if many else ''}{kind.__name__} was expected; the device is "
                                   "refused (use the fleet's page).")
    return record


def stage_reply(stage: str, record: dict[str, Any], *, device: str) -> RecordDict:
    """A device's answer to a key stage (setup, share keys, unmask) as ``secaggplus_mod`` replies it.

    Raises:
        DeviceReplyError: for a record without the stage's keys, or values of other kinds.
    """
    return RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(_checked(stage, record, device), keep_input=False)})


def masked_reply(record: dict[str, Any], shapes: Sequence[tuple[int, ...]], examples: int,
                 metrics: dict[str, Any], *, device: str) -> RecordDict:
    """A device's masked vectors as ``secaggplus_mod`` replies them: a legacy ``FitRes`` without parameters.

    `shapes` are the legacy parameters' shapes: each masked vector must be an int64 ``.npy`` of its shape
    (the weight's, ``(1,)``, first), since Flower's workflow sums them as they come.

    Raises:
        DeviceReplyError: for a record without ``masked_params``, or vectors of other count, type or shape.
    """
    vectors = _checked(Stage.COLLECT_MASKED_VECTORS, record, device)[Key.MASKED_PARAMETERS]
    wanted = [(1,), *shapes]
    try:
        found = [(array.dtype, array.shape) for array in map(bytes_to_ndarray, vectors)]
    except (ValueError, EOFError, OSError) as error:
        raise DeviceReplyError(f"{device} sent masked vectors that are not .npy bytes ({error}); the device is refused "
                               "(use the fleet's page).") from None
    if found != [(np.dtype(np.int64), tuple(shape)) for shape in wanted]:
        raise DeviceReplyError(f"{device} sent masked vectors of {[(str(d), s) for d, s in found]}, but int64 arrays "
                               f"of shapes {wanted} were expected; the device is refused (use the fleet's page).")
    fitres = FitRes(Status(Code.OK, ""), Parameters([], _TENSOR_TYPE), examples, metrics)
    content = compat.fitres_to_recorddict(fitres, keep_input=True)
    content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(record, keep_input=False)
    return content
