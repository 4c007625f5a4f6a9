"""Client-side DP on a device: its update clipped to the norm a train message asks for (Flower's clipping mod).

Flower's client-side DP wrappers send the norm in each train message; a device need not know the
server's privacy section. A browser or Node device clips in ``device.js`` on the same cue.
"""

from __future__ import annotations

from flwr.app import Context, Message, MessageType
from flwr.clientapp.mod import adaptiveclipping_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from ort_lightning.fleet.devices.protocol import ARRAYS_KEY

__all__ = ["clip_when_asked"]


def clip_when_asked(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``adaptiveclipping_mod`` (clips, adds ``norm_bit``) where a train message asks; install once, first.

    A legacy fit instruction (secure aggregation's) passes: `legacy_fit_mod` clips it inside the masking.
    """
    content = message.content
    asked = message.metadata.message_type == MessageType.TRAIN and ARRAYS_KEY in content.array_records and any(
        KEY_CLIPPING_NORM in record for record in content.config_records.values())
    return adaptiveclipping_mod(message, context, call_next) if asked else call_next(message, context)
