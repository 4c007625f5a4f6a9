"""``output.pretrained``: the last round written as the folder transformers or peft loads (``folder/pretrained``)."""

from __future__ import annotations

import os
from pathlib import Path

from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.config.fleet_config import FleetConfig
from ort_lightning.fleet.server.global_model import LAST_NAME
from ort_lightning.training.checkpointing.pretrained import save_pretrained

__all__ = ["PRETRAINED_DIR", "write_last_round"]

#: The subfolder of ``output.folder`` that ``output.pretrained`` writes.
PRETRAINED_DIR = "pretrained"


def write_last_round(config: FleetConfig, artifacts: str | os.PathLike[str]) -> Path:
    """Write ``rounds/last.ortckpt`` through the exported model's own ``save_pretrained`` (a peft adapter folder).

    Raises:
        ConfigurationError: when no round was written (every device failed every round).
        ArtifactError: for artifacts exported from a model that is no transformers or peft model.
    """
    out = Path(config.output.folder)
    last = out / "rounds" / LAST_NAME
    if not last.is_file():
        raise ConfigurationError(f"`output.pretrained` writes the last round, but {last} was not written: no round "
                                 "aggregated any device; see the round lines for why the devices failed.")
    return save_pretrained(last, out / PRETRAINED_DIR, artifacts=artifacts)
