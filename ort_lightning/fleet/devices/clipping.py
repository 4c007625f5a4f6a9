"""The Flower mods a device's ``ClientApp`` runs for the fleet's privacy section: client-side DP clips on the device.

Flower's ``DifferentialPrivacyClientSide*Clipping`` wrappers send the clipping norm in each train
message and expect the device to clip its update (trained minus received weights) to it before
it replies; ``fixedclipping_mod`` and ``adaptiveclipping_mod`` (which also reports ``norm_bit``,
whether it clipped) do that around the device's own ``train``. A browser or Node device clips in
``device.js`` instead.

Example::

    >>> [mod.__name__ for mod in clipping_mods({"side": "client", "clipping": "adaptive"})]
    ['adaptiveclipping_mod']
    >>> clipping_mods({"side": "server", "clipping": "fixed"}), clipping_mods(None)
    ([], [])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod
from flwr.clientapp.typing import Mod

__all__ = ["clipping_mods"]


def clipping_mods(privacy: Mapping[str, Any] | None) -> list[Mod]:
    """The mods for `privacy` (the config's section, or None): Flower's clipping mod where the device clips, else none.

    Pass them to the device's ``client_app(mods=...)``; a server-side or absent privacy section needs none.
    """
    if not privacy or privacy.get("side") != "client":
        return []
    return [adaptiveclipping_mod if privacy.get("clipping") == "adaptive" else fixedclipping_mod]
