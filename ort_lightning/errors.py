"""Exceptions raised by ort-lightning.

Every message says what was wrong, what was expected and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "ArtifactError",
    "BatchError",
    "CheckpointError",
    "ConfigurationError",
    "CudaError",
    "DeviceReplyError",
    "DistributedError",
    "ExportError",
    "FleetError",
    "NonFiniteLossError",
    "ORTLightningError",
    "StorageError",
]


class ORTLightningError(Exception):
    """Base class of every error that ort-lightning raises on purpose."""


class ArtifactError(ORTLightningError, ValueError):
    """Training artifacts are missing, foreign, or unreadable by the installed ONNX Runtime."""


class ExportError(ORTLightningError, ValueError):
    """A model or an option given to `export_artifacts` cannot be turned into artifacts."""


class BatchError(ORTLightningError, ValueError):
    """A batch does not match the inputs of the training or eval graph."""


class CudaError(ORTLightningError, RuntimeError):
    """A compute device that is not ``cpu``, ``cuda`` or ``cuda:N``, or CUDA asked of ONNX Runtime's CPU build."""


class DistributedError(ORTLightningError, RuntimeError):
    """Another rank of a distributed run is gone (its process died, or never answered a collective)."""


class ConfigurationError(ORTLightningError, ValueError):
    """A Trainer or module option that ort-lightning cannot honour."""


class CheckpointError(ORTLightningError, ValueError):
    """A checkpoint is missing, corrupted, truncated, or does not match the artifacts."""


class NonFiniteLossError(ORTLightningError, FloatingPointError):
    """A training loss was NaN or infinite, and the module's ``on_nonfinite`` policy is ``"raise"``."""


class StorageError(ORTLightningError, OSError):
    """A file could not be written (no space left on device, no permission); the previous file is left intact."""


class DeviceReplyError(ORTLightningError, ValueError):
    """What a fleet device sent back was refused before it reached the strategy; the device is dropped."""


class FleetError(ORTLightningError, RuntimeError):
    """A fleet cannot go on: too few devices stayed connected for longer than the fleet waits."""
