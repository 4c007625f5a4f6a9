"""The browser fleet tests' shared artifacts: the digits MLP exported once, and its web-prepared device folder."""

from __future__ import annotations

import pytest
import torch

from ort_lightning import TrainingArtifacts, export_artifacts
from ort_lightning.demo import FEATURES, digits_mlp


@pytest.fixture(scope="session")
def digits_folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainingArtifacts, TrainingArtifacts]:
    """The digits MLP exported once (the server's folder) and its web-prepared device folder (lr 0.01, constant)."""
    from ort_lightning.export import prepare_for_web
    from tests.fleet.engines.browser.digits_rounds import HIDDEN, LR  # ort_lightning.fleet needs Flower

    root = tmp_path_factory.mktemp("browser-fleet")
    exported = export_artifacts(digits_mlp(HIDDEN, seed=0), torch.zeros(2, FEATURES), root / "exported",
                                nominal_checkpoint=True, ort_format=True, verify=False)
    return exported, prepare_for_web(exported, root / "web", lr=LR)
