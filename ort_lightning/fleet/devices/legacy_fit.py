"""The one place where a fleet's records meet Flower's legacy fit records, which SecAgg+ still speaks.

Flower 1.42's ``SecAggPlusWorkflow`` runs under ``LegacyContext`` and its client mod reads a legacy
``FitRes`` (``fitres.parameters``), whereas `DeviceClient` takes and replies an ``ArrayRecord`` under
``"arrays"`` and a ``MetricRecord`` under ``"metrics"``. Legacy ``Parameters`` carry no names, so the
server sends them in the fit config under `NAMES_KEY`. `legacy_fit_mod` goes inside Flower's
``secaggplus_mod``: it converts the instruction in, the reply out, and clips in between where asked.
`secure_when_asked` runs the two on the messages of a SecAgg+ round and passes the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitRes, Parameters, Status
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat

from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.devices.clipping import clip_when_asked
from ort_lightning.fleet.devices.protocol import ARRAYS_KEY, METRICS_KEY, WEIGHT_KEY

__all__ = ["NAMES_KEY", "arrays_to_parameters", "fit_reply", "fit_request", "legacy_fit_mod", "parameters_to_arrays",
           "secure_when_asked"]

#: The fit config's key holding the names of the legacy parameters, in their order.
NAMES_KEY = "ort-lightning.names"
_FITINS = "fitins.parameters"
_TENSOR_TYPE = "numpy.ndarray"


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
    from flwr.common import bytes_to_ndarray

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
