"""Strategies: ``ort_ddp``, distributed data parallel training of ORT artifacts, and its coalesced all-reduce."""

from ort_lightning.strategies.ddp import ORTDDPStrategy, check_strategy, thread_spinning

__all__ = ["ORTDDPStrategy", "check_strategy", "thread_spinning"]
