"""Client-side differential privacy on a device: its update clipped to the norm the server's train message asks for.

Flower's ``DifferentialPrivacyClientSide*Clipping`` wrappers put the clipping norm in each train
message's config and trust the device to clip its update (trained minus received weights) to it
before it replies. `clip_when_asked` is the mod every device's ``ClientApp`` runs first: where a
message carries the norm, Flower's ``adaptiveclipping_mod`` clips and adds ``norm_bit`` (whether it
clipped, which the adaptive wrapper needs and the fixed one ignores); elsewhere it does nothing, so
the device need not know the server's privacy section. A browser or Node device clips in
``device.js`` the same way.
"""

from __future__ import annotations

from flwr.app import Context, Message, MessageType
from flwr.clientapp.mod import adaptiveclipping_mod
from flwr.clientapp.typing import ClientAppCallable

__all__ = ["clip_when_asked"]

#: Flower's config key for the norm (``flwr.supercore.differential_privacy.KEY_CLIPPING_NORM``).
CLIPPING_NORM_KEY = "clipping_norm"


def clip_when_asked(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """A Flower mod: Flower's clipping around the device's ``train`` where the message asks for it (install it once)."""
    asked = message.metadata.message_type == MessageType.TRAIN and any(
        CLIPPING_NORM_KEY in record for record in message.content.config_records.values())
    return adaptiveclipping_mod(message, context, call_next) if asked else call_next(message, context)
