"""The ``ort-lightning`` console script: demo, export, inspect and the LightningCLI subcommands."""

from ort_lightning.cli.console import main

__all__ = ["main"]
