"""The folder contract: `TrainingArtifacts.load` validates an artifacts folder and reads its manifest.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import export_artifacts, TrainingArtifacts
    >>> folder = tempfile.mkdtemp()
    >>> _ = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), folder)
    >>> TrainingArtifacts.load(folder).manifest.optimizer
    'adamw'
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from ort_lightning.artifacts.adopted import adopted_files, adopted_manifest
from ort_lightning.artifacts.manifest import MANIFEST_NAME, UNVERIFIED_NAME, Manifest
from ort_lightning.errors import ArtifactError
from ort_lightning.ort import limits
from ort_lightning.ort import runtime as _ort

__all__ = ["FILES", "TrainingArtifacts"]

FILES = {
    "training_model": "training_model.onnx",
    "eval_model": "eval_model.onnx",
    "optimizer_model": "optimizer_model.onnx",
    "checkpoint": "checkpoint",
}

@dataclass(frozen=True)
class TrainingArtifacts:
    """A validated artifacts folder: the paths of its four files and its manifest.

    A folder that ``onnxruntime.training.artifacts.generate_artifacts`` wrote (no manifest) is
    adopted: `files` then holds its paths (a ``prefix=``, ``.ort`` graphs, no optimizer graph).
    """

    directory: Path
    manifest: Manifest
    #: Paths by role for an adopted folder; None for `export_artifacts`' own layout (`FILES`).
    files: dict[str, Path | None] | None = field(default=None, compare=False)

    def _file(self, role: str) -> Path:
        if self.files is None:
            return self.directory / FILES[role]
        path = self.files[role]
        if path is None:
            raise ArtifactError(f"{self.directory} has no {role}; regenerate the folder with one.")
        return path

    @property
    def training_model(self) -> Path:
        """Forward, loss and gradient graph."""
        return self._file("training_model")

    @property
    def eval_model(self) -> Path:
        """Forward and loss graph in inference mode (Dropout off, BatchNorm running statistics)."""
        return self._file("eval_model")

    @property
    def optimizer_model(self) -> Path | None:
        """Optimizer update graph; None for a folder generated with ``optimizer=None``."""
        if self.files is not None and self.files["optimizer_model"] is None:
            return None
        return self._file("optimizer_model")

    @property
    def checkpoint(self) -> Path:
        """Initial parameters as an ORT CheckpointState file."""
        return self._file("checkpoint")

    @property
    def nominal_checkpoint(self) -> Path | None:
        """ORT's weightless checkpoint beside `checkpoint` (names and shapes only), None when the folder has none.

        ``export_artifacts(..., nominal_checkpoint=True)`` and ``generate_artifacts(..., nominal_checkpoint=True)``
        write it; a device that receives its weights from elsewhere (a fleet's server) starts from it.
        """
        complete = self.checkpoint
        path = complete.with_name(complete.name[: -len("checkpoint")] + "nominal_checkpoint")
        return path if path.is_file() else None

    @property
    def adopted(self) -> bool:
        """Whether the folder came from ``generate_artifacts`` (no manifest) rather than `export_artifacts`."""
        return self.files is not None

    @classmethod
    def load(
        cls, directory: str | os.PathLike[str], *, labels: Sequence[str] | None = None, prefix: str | None = None
    ) -> TrainingArtifacts:
        """Validate an artifacts folder and read its manifest, or derive one from a ``generate_artifacts`` folder.

        Args:
            directory: the folder.
            labels: for a folder without manifest whose loss is a custom block: the label inputs
                (``[]``: none). None reads them from ORT's names (``labels``, ``target``). With a
                manifest, they must be the labels it records (`check_labels`).
            prefix: the ``prefix=`` given to ``generate_artifacts``; None finds it.

        Raises:
            ArtifactError: for a missing folder or file, a foreign manifest, a graph whose ONNX IR
                version ORT 1.19.2 cannot read, a folder whose labels cannot be told, or `labels`
                that disagree with the manifest.

        Example::

            >>> import tempfile, torch
            >>> from ort_lightning import export_artifacts
            >>> folder = tempfile.mkdtemp()
            >>> _ = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), folder)
            >>> TrainingArtifacts.load(folder).adopted
            False
        """
        folder = _check_folder(Path(directory))
        _check_verified(folder)
        manifest_path = folder / MANIFEST_NAME
        if not manifest_path.is_file() or prefix is not None:
            return cls._adopt(folder, labels=labels, prefix=prefix)
        manifest = Manifest.from_json(manifest_path.read_text(encoding="utf-8"), manifest_path)
        _check_versions(manifest, manifest_path)
        artifacts = cls(folder, manifest)
        for name in FILES:
            path = getattr(artifacts, name)
            if not path.is_file():
                raise ArtifactError(
                    f"Artifact {path} is missing; re-export the folder with export_artifacts() rather than "
                    "copying files by hand."
                )
        for name in ("training_model", "eval_model", "optimizer_model"):
            _check_ir_version(getattr(artifacts, name))
        artifacts.check_labels(labels)
        return artifacts

    def check_labels(self, labels: Sequence[str] | None) -> None:
        """Refuse `labels` (an explicit ``labels=``) that are not the labels these artifacts have.

        An exported folder's manifest says which graph inputs are labels; ``labels=`` is for a
        ``generate_artifacts`` folder without one. The same labels are accepted, others refused.

        Raises:
            ArtifactError: naming both lists and what to do.
        """
        recorded = [spec.name for spec in self.manifest.labels]
        if labels is None or list(labels) == recorded:
            return
        where = "read from its graphs" if self.adopted else f"recorded in its {MANIFEST_NAME}"
        raise ArtifactError(
            f"labels={list(labels)} disagrees with the labels of {self.directory}: {recorded}, {where} (model "
            f"inputs {[spec.name for spec in self.manifest.inputs]}). Leave labels= out for an exported folder, "
            "whose manifest says which inputs are labels (labels= is for generate_artifacts folders without one), "
            "or re-export the model with the labels you mean."
        )

    @classmethod
    def _adopt(cls, folder: Path, *, labels: Sequence[str] | None, prefix: str | None) -> TrainingArtifacts:
        files = adopted_files(folder, prefix)
        for path in files.values():
            if path is not None and path.suffix == ".onnx":
                _check_ir_version(path)
        return cls(folder, adopted_manifest(files, labels=labels), files)


def _check_folder(folder: Path) -> Path:
    if folder.is_dir():
        return folder
    if folder.exists():
        raise ArtifactError(
            f"{folder} is not a folder; pass the folder that export_artifacts() wrote (here perhaps "
            f"{folder.parent}), not one of its files."
        )
    raise ArtifactError(
        f"Artifacts folder {folder} does not exist; create it with "
        "export_artifacts(model, example_inputs, output_dir)."
    )


def _check_verified(folder: Path) -> None:
    marker = folder / UNVERIFIED_NAME
    if marker.is_file():
        raise ArtifactError(
            f"{folder} holds graphs whose export-time verification failed ({marker.read_text(encoding='utf-8')}); "
            "they are not loaded. Fix the model or export again with export_artifacts(..., verify=False) to "
            "accept them."
        )


def _release(version: str) -> tuple[str, ...]:
    """Major and minor of a version string: ``"1.19.2" -> ("1", "19")``."""
    return tuple(version.split("+")[0].split(".")[:2])


def _check_versions(manifest: Manifest, source: Path) -> None:
    """Refuse artifacts whose graphs another ONNX Runtime release generated."""
    written = manifest.versions.get("onnxruntime")
    installed = _ort.versions()["onnxruntime"]
    if written is not None and _release(written) != _release(installed):
        raise ArtifactError(
            f"{source} says these artifacts were generated by onnxruntime {written}, but {installed} is "
            f"installed, and training graphs are only read by the release that wrote them; re-export the "
            f"model with export_artifacts() here, or install onnxruntime-training=={written}."
        )


def _check_ir_version(path: Path) -> None:
    try:
        ir_version = onnx.load(path, load_external_data=False).ir_version
    except Exception as error:  # onnx raises DecodeError and friends for a damaged file
        raise ArtifactError(
            f"{path} is not a readable ONNX model ({error}); re-export the artifacts."
        ) from error
    if ir_version > limits.MAX_IR_VERSION:
        raise ArtifactError(
            f"{path} has ONNX IR version {ir_version}, but ONNX Runtime 1.19.2 reads IR <= "
            f"{limits.MAX_IR_VERSION}; re-export with export_artifacts() (it lowers the IR version) or "
            "install onnx==1.17.0 before generating artifacts."
        )
