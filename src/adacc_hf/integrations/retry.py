"""Out of memory in a `Trainer`'s step is survived: its ``training_step`` runs through the
engine's `engine.retry.StepRetry` (the rule itself, and where it cannot hold, is there)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..engine.retry import StepRetry

__all__ = ["find_trainer", "trainer_can_retry", "wrap_trainer"]


def trainer_can_retry(trainer: Any, session: Any) -> bool:
    """Whether a Trainer's steps can be retried: a planning session and one process whose
    gradients live in the parameters (DeepSpeed and FSDP keep their own; another rank would wait
    forever)."""
    args = trainer.args
    return (
        session is not None
        and not session.fixed
        and args.world_size == 1
        and args.n_gpu <= 1
        and not getattr(trainer, "is_deepspeed_enabled", False)
        and not getattr(trainer, "is_fsdp_enabled", False)
    )


def wrap_trainer(
    trainer: Any, session: Callable[[], Any], on_retry: Callable[[], None] | None = None
) -> StepRetry:
    """Route `trainer`'s ``training_step`` (any Trainer subclass's, TRL's included) through a
    `StepRetry` keyed on the optimizer step; idempotent."""
    existing = trainer.__dict__.get("_adacc_retry")
    if existing is not None:
        return existing
    original = trainer.training_step
    retry = StepRetry(session, trainer.model, torch.device(trainer.args.device), on_retry)

    def training_step(model: Any, inputs: Any, *rest: Any, **kw: Any) -> Any:
        if not trainer_can_retry(trainer, session()):
            return original(model, inputs, *rest, **kw)
        return retry.micro_batch(
            trainer.state.global_step, lambda i, r: original(model, i, *r, **kw), inputs, rest
        )

    trainer.training_step = training_step
    trainer.__dict__["_adacc_retry"] = retry
    return retry


def find_trainer() -> Any:
    """The `transformers.Trainer` whose callback is running (callbacks are not handed their
    trainer: found as ``self`` of a calling frame), or None."""
    import inspect

    from transformers import Trainer

    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None
