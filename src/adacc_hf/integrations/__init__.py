"""Wiring into HF Trainer, Accelerate and custom loops."""

from .session import AdaccConfig, AdaccEvent, AdaccSession, prepare
from .trainer import (
    AdaccCallback,
    AdaccTrainer,
    AdaccTrainingArguments,
    policy_card_summary,
    read_artifacts,
    write_artifacts,
)

__all__ = [
    "AdaccCallback",
    "AdaccConfig",
    "AdaccEvent",
    "AdaccSession",
    "AdaccTrainer",
    "AdaccTrainingArguments",
    "policy_card_summary",
    "prepare",
    "read_artifacts",
    "write_artifacts",
]
