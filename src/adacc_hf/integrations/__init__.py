"""Wiring into HF Trainer, TRL, Accelerate and custom loops.

Rooms: `session` (profile, solve, apply, evolve; its `plans` per bucket of `shapes`), `prepare`
(custom loops, Accelerate), `coordinator` (who decides across ranks), `sharding` (per-device static
memory of sharded runs), `callback` (any Trainer), `arguments` (`--adacc...` options), `trainer`
(`AdaccTrainer`), `card` (artifacts on disk, model card, config entry).
"""

from .card import read_artifacts, update_model_card, write_artifacts
from .config import AdaccConfig
from .coordinator import Coordinator, DistributedCoordinator, coordinator_for_process
from .prepare import prepare
from .session import AdaccEvent, AdaccSession
from .trainer import AdaccCallback, AdaccTrainer, AdaccTrainingArguments, run_config

__all__ = [
    "AdaccCallback",
    "AdaccConfig",
    "AdaccEvent",
    "AdaccSession",
    "AdaccTrainer",
    "AdaccTrainingArguments",
    "Coordinator",
    "DistributedCoordinator",
    "coordinator_for_process",
    "prepare",
    "read_artifacts",
    "run_config",
    "update_model_card",
    "write_artifacts",
]
