"""What rebuilds a transformers model, recorded beside the artifacts at export.

For a transformers or peft model, `write_record` writes ``pretrained/``: the config as
transformers writes it, each adapter's config as peft writes it, and the class and adapters'
names; the write-back rebuilds the model from them without a download.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ort_lightning.errors import ArtifactError

__all__ = ["RECORD_DIR", "PretrainedRecord", "is_pretrained", "read_record", "write_record"]

#: The subfolder of an artifacts folder that holds the record.
RECORD_DIR = "pretrained"
_RECORD_NAME = "ort_lightning_pretrained.json"
_ADAPTERS = "adapters"
_FORMAT = "ort-lightning/pretrained"
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class PretrainedRecord:
    """What rebuilds the exported model: its record's `directory`, `model_class`, `adapters` and `active_adapter`."""

    directory: Path
    model_class: str
    adapters: tuple[str, ...] = ()
    active_adapter: str | None = None

    def adapter_config(self, name: str) -> Path:
        """The folder that holds adapter `name`'s ``adapter_config.json``."""
        return self.directory / _ADAPTERS / name


def _loaded(module: str, name: str) -> Any:
    """Class `name` of `module` when that package is imported already, else None (nothing is imported here)."""
    package = sys.modules.get(module)
    return getattr(package, name, None) if package is not None else None


def is_pretrained(model: object) -> bool:
    """Whether `model` is a transformers ``PreTrainedModel`` or a peft ``PeftModel`` over one."""
    pretrained, peft_model = _loaded("transformers", "PreTrainedModel"), _loaded("peft", "PeftModel")
    if pretrained is None:
        return False
    if peft_model is not None and isinstance(model, peft_model):
        return isinstance(model.get_base_model(), pretrained)
    # NOTE: adapters injected without a PeftModel leave a `peft_config` on the model: its class alone is not it.
    return isinstance(model, pretrained) and not hasattr(model, "peft_config")


def write_record(model: object, folder: Path) -> bool:
    """Write the record of `model` into ``folder/pretrained``; False (nothing written) for another model."""
    if not is_pretrained(model):
        return False
    peft_model = _loaded("peft", "PeftModel")
    adapted = peft_model is not None and isinstance(model, peft_model)
    base: Any = model.get_base_model() if adapted else model  # type: ignore[attr-defined]
    directory = folder / RECORD_DIR
    directory.mkdir()
    config = copy.deepcopy(base.config)
    config.architectures = [type(base).__name__]
    config.save_pretrained(directory)
    generation = getattr(base, "generation_config", None)
    if generation is not None:
        with contextlib.suppress(ValueError):
            # NOTE: transformers validates a generation config as it saves it and refuses one it finds
            # inconsistent; such a record keeps the config alone, and the rebuilt model the defaults it gives.
            generation.save_pretrained(directory)
    adapters: list[str] = []
    active = None
    if adapted:
        configs = model.peft_config  # type: ignore[attr-defined]
        adapters = list(configs)
        for name in adapters:
            configs[name].save_pretrained(directory / _ADAPTERS / name)
        active = model.active_adapter  # type: ignore[attr-defined]
    record = {
        "format": _FORMAT, "format_version": _FORMAT_VERSION,
        "model_class": f"{type(base).__module__}.{type(base).__qualname__}",
        "adapters": adapters, "active_adapter": active,
    }
    (directory / _RECORD_NAME).write_text(json.dumps(record, indent=2), encoding="utf-8")
    return True


def read_record(folder: Path) -> PretrainedRecord:
    """Read the record of the artifacts folder `folder` (`ArtifactError` when there is none)."""
    path = folder / RECORD_DIR / _RECORD_NAME
    if not path.is_file():
        raise ArtifactError(
            f"{folder} records no transformers model ({RECORD_DIR}/{_RECORD_NAME} is missing): export_artifacts "
            "records one when the model is a transformers PreTrainedModel or a peft PeftModel over one, and this "
            "folder was exported from another model, from an ONNX file, or before the record existed; pass the torch "
            "model the artifacts were exported from: save_pretrained(source, folder, model=model)."
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") == _FORMAT and int(data.get("format_version", 0)) <= _FORMAT_VERSION:
            return PretrainedRecord(
                folder / RECORD_DIR, str(data["model_class"]), tuple(map(str, data.get("adapters", ()))),
                data.get("active_adapter"),
            )
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    raise ArtifactError(
        f"{path} is not a record of a transformers model that this version of ort-lightning reads; export the "
        "model again with export_artifacts(), or pass it: save_pretrained(source, folder, model=model)."
    )
