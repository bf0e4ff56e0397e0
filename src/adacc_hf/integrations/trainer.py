"""HF Trainer integration: `AdaccCallback`, `AdaccTrainingArguments` and `AdaccTrainer`.

* ``Trainer(..., callbacks=[AdaccCallback(budget="20GiB")])`` works with any `TrainingArguments`
  (TRL's configs included): the callback reads the optimizer, mixed precision and sharding off the
  run's arguments.
* ``Trainer(args=AdaccTrainingArguments(adacc=True, adacc_memory_budget="20GiB"))``: the same,
  with the options on the command line (``--adacc --adacc_memory_budget 20GiB``).
* `AdaccTrainer` adds log events for the policy and its switches, resume, and the model card.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from ..engine.autobatch import BatchChoice, choose_micro_batch
from ..engine.session import AdaccSession
from ..errors import AdaccError
from .arguments import AdaccTrainingArguments
from .callback import AdaccCallback
from .card import (
    POLICY_FILE,
    PROFILE_FILE,
    STATE_FILE,
    config_entry,
    update_model_card,
    write_artifacts,
)
from .run_facts import longest_sequence, run_config

logger = logging.getLogger("adacc_hf")

__all__ = [
    "POLICY_FILE",
    "PROFILE_FILE",
    "STATE_FILE",
    "AdaccCallback",
    "AdaccTrainer",
    "AdaccTrainingArguments",
    "longest_sequence",
    "run_config",
]


class AdaccTrainer(Trainer):
    """`Trainer` with the whole Adacc experience, built as a `Trainer` is.

    Beyond a plain `Trainer` with `AdaccCallback`: the policy table and every switch as log
    events, artifacts in every checkpoint, resume, the policy in the model card and
    ``config.json``, and ``adacc_auto_batch_size`` (the micro-batch planned on the first global
    batch before the data loader is built). The options come from `AdaccTrainingArguments` (with
    ``adacc=True``) or from an `AdaccCallback` in ``callbacks``; the session is
    ``trainer.adacc_session`` once training starts.

    Args:
        *args: `Trainer`'s positional arguments (``model``, ``args``, ...).
        **kwargs: `Trainer`'s keyword arguments (``callbacks=[AdaccCallback(...)]`` among them).

    Raises:
        AdaccError: neither `AdaccTrainingArguments` nor an `AdaccCallback` given.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._adacc_cb = next(
            (c for c in self.callback_handler.callbacks if isinstance(c, AdaccCallback)), None
        )
        if self._adacc_cb is None:
            if not isinstance(self.args, AdaccTrainingArguments):
                raise AdaccError(
                    "AdaccTrainer needs AdaccTrainingArguments or callbacks=[AdaccCallback(...)]"
                )
            if self.args.adacc:
                self._adacc_cb = AdaccCallback()
                self.add_callback(self._adacc_cb)

    @property
    def adacc_session(self) -> AdaccSession | None:
        return self._adacc_cb.session if self._adacc_cb is not None else None

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)
        if self._adacc_cb is not None:
            self._adacc_cb.resume_dir = path if isinstance(path, str) else None
            config = run_config(self._adacc_cb._config(self.args), self.args)
            if config.auto_batch_size and self._adacc_cb.policy is None:
                self._adacc_cb.batch_choice = self._choose_micro_batch(config)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _choose_micro_batch(self, config: Any) -> BatchChoice:
        """Plan the micro-batch on the first global batch of the training set (in order: no
        sampler's random state is used), then set the per-device batch and accumulation the data
        loader and the loop are built from."""
        args = self.args
        if getattr(args, "deepspeed", None) or self.is_deepspeed_enabled:
            raise AdaccError(
                "adacc auto_batch_size does not run with DeepSpeed yet (its config fixes the "
                "micro-batch when the arguments are made): set the batch size yourself"
            )
        global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
        sample = next(
            iter(
                self._get_dataloader(
                    dataset=self.train_dataset,
                    description="Training",
                    batch_size=global_batch,
                )
            )
        )
        model = self.accelerator.unwrap_model(self.model) if self.accelerator else self.model
        choice = choose_micro_batch(model, sample, config, global_batch)
        args.per_device_train_batch_size = choice.micro_batch
        args.gradient_accumulation_steps = choice.accumulation
        self._train_batch_size = args.train_batch_size
        logger.info(
            "adacc auto micro-batch: per_device_train_batch_size=%d, "
            "gradient_accumulation_steps=%d",
            choice.micro_batch,
            choice.accumulation,
        )
        return choice

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """The Trainer's step, then the session's events as log entries (a step that runs out
        of memory is re-planned and run again: `retry`, as under any Trainer)."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._log_adacc_events()
        return loss

    def _log_adacc_events(self) -> None:
        session = self.adacc_session
        if session is None:
            return
        for event in session.drain_events():
            if event.kind == "track":
                continue
            if event.kind != "policy" and event.policy is not None and self.is_world_process_zero():
                logger.info("adacc %s at step %d: %s", event.kind, event.step, event.message)
            self.log({"adacc/event_" + event.kind: 1.0, **event.metrics})

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        session = self.adacc_session
        policy = session.policy if session is not None else None
        model = self.accelerator.unwrap_model(self.model) if self.accelerator else self.model
        with config_entry(getattr(model, "config", None), policy):
            super().save_model(output_dir, _internal_call)
        if session is not None and self.args.should_save:
            write_artifacts(output_dir or self.args.output_dir, session)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        super().create_model_card(*args, **kwargs)
        session = self.adacc_session
        if session is None or session.policy is None or not self.is_world_process_zero():
            return
        device = session.device
        # CUDA counts what the run allocated at its highest (profiling and evaluation included);
        # a CPU run measured nothing the card could show
        measured = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        update_model_card(self.args.output_dir, session.policy, measured)
