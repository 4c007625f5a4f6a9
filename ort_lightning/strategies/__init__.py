"""Strategies: ``ort_ddp``, distributed data parallel training of ORT artifacts, and its coalesced all-reduce."""

from ort_lightning.strategies.ddp import ORTDDPStrategy, check_strategy, thread_spinning, trains_ort_graphs

__all__ = ["ORTDDPStrategy", "check_strategy", "thread_spinning", "trains_ort_graphs"]
