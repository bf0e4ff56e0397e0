"""`AdaccCallback`: Adacc inside any `Trainer` (TRL's included); what it reads off the run is
`run_facts`."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from typing_extensions import Unpack

from ..adapters import unwrap_model
from ..engine.config import AdaccConfig
from ..engine.options import AdaccOptions
from ..engine.patch import owner_of
from ..engine.saved import read_profiles
from ..engine.session import AdaccSession
from ..errors import AdaccError
from ..policy import Policy
from ..schema import Profile
from .card import read_artifacts, write_artifacts
from .run_facts import (
    batches_fetched_ahead,
    checkpointing_by_default,
    checkpointing_on,
    explicit_checkpointing_error,
    head_note,
    longest_sequence,
    run_config,
    switch_off_own_checkpointing,
)
from .wiring import attach, find_trainer

logger = logging.getLogger("adacc_hf")

__all__ = ["AdaccCallback"]


class AdaccCallback(TrainerCallback):
    """Adacc inside any `Trainer` (TRL's included), as one of its callbacks.

    It profiles the first training batch, solves, patches the model, runs the rectifier on
    tracking steps, saves the policy with every checkpoint, restores it on resume and undoes
    everything when training ends. The run's own activation checkpointing is switched off where
    only the arguments' class turned it on (TRL's configs); asked for explicitly, it is an error.

    ``AdaccCallback(config)`` or ``AdaccCallback(budget="20GiB", ...)`` (any option by its name);
    ``policy`` reuses a saved policy (object or ``adacc_policy.json`` path). With neither, the
    options come from `AdaccTrainingArguments` when the run uses them. The facts of the run
    (optimizer, mixed precision, accumulation, sharding) are read off its `TrainingArguments`
    (`RunFacts.from_training_args`).

    Args:
        config: the options (None: ``**options``, else the run's `AdaccTrainingArguments`, else
            `AdaccConfig`'s defaults).
        policy: a saved policy to run (object or ``adacc_policy.json`` path) instead of
            profiling and solving.
        **options: ``budget`` and options by name (`engine.options.AdaccOptions`), instead of
            `config`.

    Raises:
        AdaccError: both `config` and ``**options`` given, or an option `AdaccConfig` refuses.
        PolicyError: a `policy` path that does not hold a readable policy.
    """

    def __init__(
        self,
        config: AdaccConfig | None = None,
        *,
        policy: Policy | str | None = None,
        **options: Unpack[AdaccOptions],
    ) -> None:
        if config is not None and options:
            raise AdaccError("give AdaccCallback either a config or options, not both")
        self.config = AdaccConfig(**options) if options else config
        self.policy = Policy.load(policy) if isinstance(policy, str) else policy
        self.session: AdaccSession | None = None
        self.resume_dir: str | None = None  # set by the trainer's `train`; else from the state
        self.batch_choice: Any = None  # `autobatch.BatchChoice`, set by the trainer's `train`

    def _config(self, args: TrainingArguments) -> AdaccConfig:
        if self.config is not None:
            return self.config
        options = getattr(args, "adacc_config", None)  # AdaccTrainingArguments
        return options() if callable(options) else AdaccConfig()

    def _take_over(self, args: TrainingArguments, model: Any, *, peft_hooks: bool) -> None:
        """Switch the run's own activation checkpointing off when it is on only by its arguments'
        class default (TRL's configs); raise when the user asked for it."""
        if not checkpointing_on(args):
            return
        if not checkpointing_by_default(args):
            raise explicit_checkpointing_error(args)
        switch_off_own_checkpointing(args, model, peft_hooks=peft_hooks)
        logger.info(
            "adacc takes over activation checkpointing: %s turns gradient_checkpointing on by "
            "default, so the run's own is switched off and adacc's per-op policy replaces it",
            type(args).__name__,
        )

    def on_init_end(self, args, state, control, model=None, **kwargs):
        # Before `train()` enables anything: only TRL's input-gradient hooks on a PEFT model exist.
        peft = hasattr(model, "peft_config") and hasattr(model, "get_base_model")
        self._take_over(args, model, peft_hooks=peft)
        trainer = find_trainer()  # the Trainer being built: every feature wired in (`wiring`)
        if trainer is not None:
            attach(trainer, self)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        # A callback added after the Trainer was built: `train()` has enabled checkpointing.
        self._take_over(args, model, peft_hooks=False)
        owner = owner_of(unwrap_model(model))
        if owner is not None and owner is not self.session:
            logger.info("adacc: the model already has an adacc session; this callback stands by")
            return
        policy, profile, sched = self.policy, None, {}
        resume = self.resume_dir
        if resume is None and state.global_step > 0:  # resumed: the checkpoint it came from
            resume = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if resume is not None and os.path.isdir(resume):
            saved, profile, st = read_artifacts(resume)
            policy = saved or policy
            sched = st.get("schedule", {})
        if policy is None and getattr(args, "adacc_policy", None):
            policy = Policy.load(args.adacc_policy)
        reserve = 0
        if self.session is not None:  # a second train(): auto_find_batch_size after an error
            self.session.oom.check()
            reserve = self.session.oom_reserve_nbytes
            self.session.close()
        config = run_config(self._config(args), args)
        if config.solving.head == "chunked" and (note := head_note(model, "head='chunked'")):
            logger.info(note)
            config = config.replace(head="full")
        if (
            policy is not None
            and policy.head == "chunked"
            and (note := head_note(model, "the policy's head='chunked'"))
        ):
            logger.info(note)
            policy = dataclasses.replace(policy, head="full")
        choice = self.batch_choice
        if config.memory.auto_batch_size and choice is None and policy is None:
            raise AdaccError(
                "adacc auto_batch_size plans the micro-batch before the Trainer builds its data "
                "loader: give the callback when the Trainer is made (callbacks=[AdaccCallback("
                "...)] or AdaccTrainingArguments), not through add_callback afterwards"
            )
        loader = kwargs.get("train_dataloader")
        if config.memory.max_seq_len is None:
            collate = getattr(loader, "collate_fn", None)
            collate = getattr(collate, "data_collator", collate)  # Trainer's column remover
            longest = longest_sequence(args, collate, getattr(loader, "dataset", None))
            if longest is not None:
                config = config.replace(max_seq_len=longest)
        saved: tuple[list[Profile], str] | None = None
        if (
            config.tracking.profile_from is None
        ):  # an earlier run of this one saved its profiles here
            found = ((read_profiles(d, strict=False), d) for d in (resume, args.output_dir) if d)
            saved = next(((p, d) for p, d in found if p), None)
        self.session = AdaccSession(  # a choice of the automatic micro-batch (`wiring`)
            model,
            config,
            policy=policy,
            profile=profile if policy else None,
            choice=choice if policy is None else None,
        )
        if saved is not None:
            self.session.reuse_profiles(*saved)
        if sched:
            self.session.rectifier.restore(sched)
        self.session.ctx.loader_ahead = batches_fetched_ahead(loader)  # alive beside each step's
        self.session.oom_reserve_nbytes = reserve  # what the device showed it does not hold
        self.session.attach()
        trainer = find_trainer()  # an out-of-memory step is re-planned and re-run (`wiring`)
        if trainer is not None:
            attach(trainer, self)  # a callback added after the Trainer was made
        else:
            logger.info("adacc: no Trainer found above the callback: out-of-memory steps raise")

    def on_step_begin(self, args, state, control, **kwargs):
        if self.session is not None:
            self.session.on_step_begin(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        if self.session is not None:
            self.session.on_step_end(state.global_step)

    def on_save(self, args, state, control, **kwargs):
        if self.session is not None and state.is_world_process_zero:
            ckpt = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            write_artifacts(ckpt, self.session)

    def on_train_end(self, args, state, control, **kwargs):
        if self.session is not None:
            if state.is_world_process_zero:
                write_artifacts(args.output_dir, self.session)
            self.session.close()
