"""Wiring into HF Trainer, TRL, Accelerate and custom loops, over the engine (`adacc_hf.engine`).

Modules: `prepare` (custom loops, Accelerate), `callback` (any Trainer, TRL's included),
`arguments` (`--adacc...` options), `trainer` (`AdaccTrainer`), `run_facts` (what adacc reads off a
Trainer's arguments), `wiring` (what the callback wires into its Trainer: resume, automatic
micro-batch, out-of-memory retry, events as metrics, artifacts and card), `card` (artifacts on
disk, model card, config entry). The facts of a run, sharding included, are read by
`engine.facts`.
"""

from ..engine import AdaccConfig, AdaccEvent, AdaccSession
from ..engine.coordinator import Coordinator, DistributedCoordinator, coordinator_for_process
from .card import read_artifacts, update_model_card, write_artifacts
from .prepare import prepare
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
