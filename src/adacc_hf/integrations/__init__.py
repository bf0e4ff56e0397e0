"""Wiring into HF Trainer, TRL, Accelerate and custom loops.

Rooms: `session` (profile, solve, apply, evolve), `coordinator` (who decides across ranks),
`sharding` (per-device static memory of sharded runs), `trainer` (callback, arguments, trainer),
`card` (artifacts on disk, model card, config entry).
"""

from .card import read_artifacts, update_model_card, write_artifacts
from .config import AdaccConfig
from .coordinator import Coordinator, DistributedCoordinator, coordinator_for_process
from .session import AdaccEvent, AdaccSession, prepare
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
