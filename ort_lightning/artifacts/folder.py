"""The folder contract: `TrainingArtifacts.load` validates an artifacts folder and reads its manifest.

Example::

    >>> import tempfile, torch
    >>> from ort_lightning import export_artifacts, TrainingArtifacts
    >>> folder = tempfile.mkdtemp()
    >>> _ = export_artifacts(torch.nn.Linear(4, 3), torch.zeros(2, 4), folder, verify=False)
    >>> TrainingArtifacts.load(folder).manifest.optimizer
    'adamw'
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ort_lightning.artifacts.adopted import GRAPHS, adopted_files, adopted_manifest, present_files
from ort_lightning.artifacts.checks import (
    GraphFacts,
    check_checkpoint_digest,
    check_graphs,
    check_manifest,
    read_graph,
)
from ort_lightning.artifacts.manifest import MANIFEST_NAME, UNVERIFIED_NAME, Manifest
from ort_lightning.errors import ArtifactError
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
    """A validated artifacts folder: the paths of its files and its manifest.

    A ``generate_artifacts`` folder (no manifest) is adopted: its manifest is read from the graphs. A
    device folder holds graphs and the ``nominal_checkpoint`` only (`weightless`): it trains once
    weights are given (``ORTLightningModule(folder, values=...)``).
    """

    directory: Path
    manifest: Manifest
    #: Paths by role (`FILES`' roles and ``nominal_checkpoint``), None for one absent; None for `FILES` as named.
    files: dict[str, Path | None] | None = field(default=None, compare=False)
    #: Whether the folder came from ``generate_artifacts`` (no manifest) rather than `export_artifacts`.
    adopted: bool = field(default=False, compare=False)

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
    def weightless(self) -> bool:
        """Whether the folder's only checkpoint is ``nominal_checkpoint`` (a device's folder)."""
        return self.files is not None and self.files["checkpoint"] is None

    @property
    def checkpoint(self) -> Path:
        """Initial parameters as an ORT CheckpointState file.

        Raises:
            ArtifactError: for a `weightless` folder, which has none.
        """
        if self.weightless:
            raise ArtifactError(
                f"{self.directory} holds no weights: its only checkpoint is {self.nominal_checkpoint} (names and "
                "shapes, as a device receives it), so it has no complete checkpoint to read; pass the weights with "
                "ORTLightningModule(folder, values={name: tensor}), or copy the complete checkpoint beside the graphs."
            )
        return self._file("checkpoint")

    @property
    def nominal_checkpoint(self) -> Path | None:
        """ORT's weightless checkpoint (names and shapes only), None when the folder has none."""
        graph = self.training_model.name
        path = self.directory / f"{graph[: graph.rindex('training_model')]}nominal_checkpoint"
        return path if path.is_file() else None

    @classmethod
    def load(
        cls, directory: str | os.PathLike[str], *, labels: Sequence[str] | None = None, prefix: str | None = None
    ) -> TrainingArtifacts:
        """Validate an artifacts folder and read its manifest, or derive one from a ``generate_artifacts`` folder.

        Args:
            directory: the folder.
            labels: for a folder without manifest whose loss is a custom block: the label inputs
                (``[]``: none); with a manifest, they must be the ones it records.
            prefix: the ``prefix=`` given to ``generate_artifacts``; None finds it.

        Raises:
            ArtifactError: for a missing folder or file, a foreign manifest, a graph ORT 1.19.2 cannot
                read, labels that cannot be told, or `labels` that disagree with the manifest.
        """
        folder = _check_folder(Path(directory))
        _check_verified(folder)
        manifest_path = folder / MANIFEST_NAME
        if not manifest_path.is_file() or prefix is not None:
            return cls._adopt(folder, labels=labels, prefix=prefix)
        manifest = Manifest.read(manifest_path)
        _check_versions(manifest, manifest_path)
        files = _own_files(folder)
        graphs = _read_graphs(files)
        check_manifest(manifest, graphs, folder)
        _check_ort_optimizer(manifest, files, manifest_path)
        check_checkpoint_digest(manifest, files["checkpoint"])
        artifacts = cls(folder, manifest, files)
        artifacts.check_labels(labels)
        return artifacts

    def check_labels(self, labels: Sequence[str] | None) -> None:
        """Refuse an explicit ``labels=`` that are not the labels these artifacts have (`ArtifactError`)."""
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
        _read_graphs(files)
        return cls(folder, adopted_manifest(files, labels=labels), files, adopted=True)


def _own_files(folder: Path) -> dict[str, Path | None]:
    """The files of `export_artifacts`' layout: ``.onnx`` graphs, else ``.ort``; a checkpoint, else the nominal one."""
    # NOTE: an export writes both formats from one graph; comparing them would load every .ort graph on each load.
    files = present_files(folder, "", check_formats=False)
    for role in (*GRAPHS, "checkpoint"):
        if files[role] is None and not (role == "checkpoint" and files["nominal_checkpoint"] is not None):
            raise ArtifactError(
                f"Artifact {folder / FILES[role]} is missing; re-export the folder with export_artifacts() rather than "
                "copying files by hand."
            )
    return files


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


def _read_graphs(files: dict[str, Path | None]) -> dict[str, GraphFacts]:
    """Read each ``.onnx`` graph once and check that it is the graph of its slot; role -> its facts."""
    graphs = {role: read_graph(path) for role in GRAPHS
              if (path := files.get(role)) is not None and path.suffix == ".onnx"}
    check_graphs(graphs)
    return graphs


def _check_ort_optimizer(manifest: Manifest, files: dict[str, Path | None], source: Path) -> None:
    """The optimizer kind of an ``.ort`` optimizer graph (read from its operator list) against the manifest's."""
    path = files.get("optimizer_model")
    if path is None or path.suffix != ".ort":
        return
    kind = _ort.optimizer_kind_in(path)
    if kind != manifest.optimizer:
        raise ArtifactError(
            f"{source} says optimizer={manifest.optimizer!r}, but {path.name} runs {kind!r}: the optimizer graph or "
            "the manifest is of another export; re-export the artifacts with export_artifacts(), or copy the whole "
            "folder again from where it was exported."
        )
