"""What adacc adds to a `transformers.Trainer`, wired into the trainer object: one home for every
Trainer entry point (`AdaccTrainingArguments` and `AdaccCallback` in a plain `Trainer` or TRL's
trainers, and `AdaccTrainer`), so each gets the same features.

`attach(trainer, callback)` replaces four of the trainer's methods on the instance (any subclass's
own, TRL's included; idempotent). The callback attaches from ``on_init_end``, where it finds its
trainer as ``self`` of a calling frame (`find_trainer`): the Trainer builds its callbacks while it
is made, before anything trains.

* ``train``: the checkpoint it resumes from handed to the callback, and with ``auto_batch_size``
  the micro-batch planned on the first global batch (`engine.autobatch`) before the data loader
  is built from ``per_device_train_batch_size``.
* ``training_step``: a step that runs out of memory is re-planned and run again
  (`engine.retry.StepRetry`, where one process holds the gradients: `trainer_can_retry`), and the
  session's events become the Trainer's logged metrics.
* ``save_model``: the policy in ``config.json`` and the artifacts beside the weights.
* ``create_model_card``: the policy in the card.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..engine.autobatch import BatchChoice, choose_micro_batch
from ..engine.retry import StepRetry
from ..errors import AdaccError
from .card import config_entry, update_model_card, write_artifacts
from .run_facts import run_config

__all__ = ["attach", "find_trainer", "log_events", "trainer_can_retry"]

logger = logging.getLogger("adacc_hf")


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


def attach(trainer: Any, callback: Any) -> None:
    """Wire `callback` (an `AdaccCallback`) into `trainer` (module docstring); idempotent."""
    if trainer.__dict__.get("_adacc_callback") is callback:
        return
    trainer.__dict__["_adacc_callback"] = callback

    def session() -> Any:
        return callback.session

    _wrap_train(trainer, callback)
    _wrap_training_step(trainer, session)
    _wrap_saving(trainer, session)


def _unwrapped(trainer: Any) -> Any:
    return trainer.accelerator.unwrap_model(trainer.model) if trainer.accelerator else trainer.model


def _wrap_train(trainer: Any, callback: Any) -> None:
    original = trainer.train

    def train(resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        from transformers.trainer_utils import get_last_checkpoint

        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(trainer.args.output_dir)
        callback.resume_dir = path if isinstance(path, str) else None
        config = run_config(callback._config(trainer.args), trainer.args)
        if config.memory.auto_batch_size and callback.policy is None:
            callback.batch_choice = plan_micro_batch(trainer, config)
        return original(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train


def plan_micro_batch(trainer: Any, config: Any) -> BatchChoice:
    """Plan the micro-batch on the first global batch of `trainer`'s training set (in order: no
    sampler's random state is used), then set the per-device batch and accumulation its data
    loader and loop are built from."""
    args = trainer.args
    if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
        raise AdaccError(
            "adacc auto_batch_size does not run with DeepSpeed yet (its config fixes the "
            "micro-batch when the arguments are made): set the batch size yourself"
        )
    global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    loader = trainer._get_dataloader(
        dataset=trainer.train_dataset, description="Training", batch_size=global_batch
    )
    sample = next(iter(loader))
    choice = choose_micro_batch(_unwrapped(trainer), sample, config, global_batch)
    args.per_device_train_batch_size = choice.micro_batch
    args.gradient_accumulation_steps = choice.accumulation
    trainer._train_batch_size = args.train_batch_size
    logger.info(
        "adacc auto micro-batch: per_device_train_batch_size=%d, gradient_accumulation_steps=%d",
        choice.micro_batch,
        choice.accumulation,
    )
    return choice


def log_events(trainer: Any, session: Any) -> None:
    """The session's new events as the Trainer's logged metrics (switches and re-plans also as
    log lines on the main process). Logged through `transformers.Trainer.log` itself: a
    subclass's ``log`` may flush metrics it gathers for its own next entry (TRL's token accuracy)."""
    if session is None:
        return
    from transformers import Trainer

    for event in session.drain_events():
        if event.kind == "track":
            continue
        if event.kind != "policy" and event.policy is not None and trainer.is_world_process_zero():
            logger.info("adacc %s at step %d: %s", event.kind, event.step, event.message)
        Trainer.log(trainer, {"adacc/event_" + event.kind: 1.0, **event.metrics})


def _wrap_training_step(trainer: Any, session: Callable[[], Any]) -> None:
    original = trainer.training_step

    def on_retry() -> None:
        log_events(trainer, session())

    retry = StepRetry(session, trainer.model, torch.device(trainer.args.device), on_retry)

    def training_step(model: Any, inputs: Any, *rest: Any, **kw: Any) -> Any:
        if not trainer_can_retry(trainer, session()):
            loss = original(model, inputs, *rest, **kw)
        else:
            loss = retry.micro_batch(
                trainer.state.global_step,
                lambda i, r: original(model, i, *r, **kw),
                inputs,
                rest,
            )
        log_events(trainer, session())
        return loss

    trainer.training_step = training_step


def _wrap_saving(trainer: Any, session: Callable[[], Any]) -> None:
    save, card = trainer.save_model, trainer.create_model_card

    def save_model(output_dir: str | None = None, _internal_call: bool = False) -> None:
        s = session()
        policy = s.policy if s is not None else None
        with config_entry(getattr(_unwrapped(trainer), "config", None), policy):
            save(output_dir, _internal_call)
        if s is not None and trainer.args.should_save:
            write_artifacts(output_dir or trainer.args.output_dir, s)

    def create_model_card(*args: Any, **kwargs: Any) -> None:
        card(*args, **kwargs)
        s = session()
        if s is None or s.policy is None or not trainer.is_world_process_zero():
            return
        # CUDA counts what the run allocated at its highest (profiling and evaluation included);
        # a CPU run measured nothing the card could show
        device = s.device
        measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        update_model_card(trainer.args.output_dir, s.policy, measured)

    trainer.save_model = save_model
    trainer.create_model_card = create_model_card
