"""What the ``data`` section names, built: each device's data and the batches the global model is measured on.

A ``package.module:name`` is imported as Python imports it, with `search` (the config file's folder)
tried first, so that a module beside the config is found from any working folder.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader

from ort_lightning.demo_data import split_digits
from ort_lightning.errors import ConfigurationError
from ort_lightning.fleet.data.digits import DigitsPartitions, digits_test_loader
from ort_lightning.fleet.data.partitions import Partitions, tensor_dataset
from ort_lightning.fleet.devices.protocol import DataFn

if TYPE_CHECKING:
    from ort_lightning.fleet.config.fleet_config import FleetConfig

__all__ = ["fleet_data", "import_path"]


def import_path(path: str, *, key: str, search: Sequence[str | os.PathLike[str]] = ()) -> Any:
    """The object that ``package.module:name`` (or ``package.module.name``) names.

    Raises:
        ConfigurationError: naming `key` when the module or the name is not found.
    """
    module_name, sep, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not name:
        raise ConfigurationError(f"Expected `{key}` to be an import path package.module:name, but got {path!r}.")
    folders = [os.fspath(folder) for folder in search if os.fspath(folder) not in sys.path]
    sys.path[:0] = folders
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ConfigurationError(f"`{key}: {path}` names module {module_name!r}, which is not found ({error}); "
                                 "put it beside the config file or on PYTHONPATH.") from error
    finally:
        for folder in folders:
            sys.path.remove(folder)
    if not hasattr(module, name):
        raise ConfigurationError(f"`{key}: {path}` names {name!r}, which module {module_name} does not define.")
    return getattr(module, name)


def fleet_data(config: FleetConfig, *, search: Sequence[str | os.PathLike[str]] = ()) -> tuple[DataFn, DataLoader]:
    """Each device's data and the batches the global model is measured on, as the ``data`` section says."""
    data, devices = config.data, config.devices
    if data.class_path is None and data.partition not in ("dirichlet", "ordered"):
        return (DigitsPartitions(split=data.partition, batch_size=devices.batch_size, seed=config.seed),
                digits_test_loader(config.seed))
    if data.class_path is None:  # the digits' training split, drawn per label or cut in order
        return (Partitions(split_digits(seed=config.seed)[0], scheme=data.partition, alpha=data.alpha,
                           batch_size=devices.batch_size, seed=config.seed), digits_test_loader(config.seed))
    module = import_path(data.class_path, key="data.class_path", search=search)(**data.init_args)
    for hook in ("prepare_data", "setup"):
        if hasattr(module, hook):
            getattr(module, hook)(*(("fit",) if hook == "setup" else ()))
    held_out = _loader(module, "val_dataloader") or _loader(module, "test_dataloader")
    if held_out is None:
        raise ConfigurationError(f"Expected `data.class_path` {data.class_path} to define val_dataloader() or "
                                 "test_dataloader(), the batches the global model is measured on; add one.")
    train = tensor_dataset(module.train_dataloader().dataset)
    return Partitions(train, scheme=data.partition, alpha=data.alpha, batch_size=devices.batch_size,
                      seed=config.seed), held_out


def _loader(module: Any, name: str) -> DataLoader | None:
    hook = getattr(module, name, None)
    if not callable(hook):
        return None
    try:
        return hook()
    except Exception as error:
        # NOTE: a LightningDataModule's hook that the user did not write raises Lightning's
        # MisconfigurationException ("must be implemented"); this room imports no Lightning to name it.
        if "must be implemented" in str(error):
            return None
        raise
