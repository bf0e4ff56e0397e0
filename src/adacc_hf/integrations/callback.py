"""`AdaccCallback`: Adacc inside any `Trainer` (TRL's included), and what it reads off the run."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..adapters import unwrap_model
from ..errors import AdaccError
from ..policy import Policy
from ..runtime.head import chunked_head_problem
from ..schema import Profile
from .card import read_artifacts, write_artifacts
from .config import AdaccConfig
from .retry import find_trainer, wrap_trainer
from .saved import read_profiles
from .session import AdaccSession
from .sharding import sharding_from_trainer

logger = logging.getLogger("adacc_hf")

__all__ = [
    "AdaccCallback",
    "batches_fetched_ahead",
    "checkpointing_by_default",
    "checkpointing_on",
    "explicit_checkpointing_error",
    "flattens_batches",
    "longest_sequence",
    "run_config",
    "switch_off_own_checkpointing",
]


#: Datasets up to this many rows are scanned for their longest ``input_ids`` (cheap: lengths only).
SCAN_ROWS = 100_000


#: The two names of transformers' own activation checkpointing flag (``gradient_checkpointing``
#: is its deprecated alias from 5.23 on; older versions have only it) and of its kwargs.
_FLAGS = ("activation_checkpointing", "gradient_checkpointing")
_KWARGS = ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")
#: Checkpointing kwargs TRL writes itself (``use_reentrant``), so they say nothing of the user.
_SET_BY_TRL = frozenset({"use_reentrant"})


def checkpointing_on(args: Any) -> bool:
    """Whether the run's arguments turn on transformers' own activation checkpointing (which adacc
    replaces): ``gradient_checkpointing``, or ``activation_checkpointing`` from transformers 5.23."""
    return bool(any(getattr(args, name, False) for name in _FLAGS))


def _field_default(cls: type, name: str) -> Any:
    """The dataclass field default of `name` on `cls` (None where it has none)."""
    if not dataclasses.is_dataclass(cls):
        return None
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
    return None


def _default_on(cls: type) -> bool:
    """Whether arguments of class `cls` turn checkpointing on when neither name is given: the
    first name whose field default is set decides, as `TrainingArguments.__post_init__` resolves
    them (TRL's configs: ``gradient_checkpointing=True``)."""
    for name in _FLAGS:
        value = _field_default(cls, name)
        if value is not None:
            return bool(value)
    return False


def _configured(args: Any) -> list[str]:
    """The checkpointing kwargs a user set (``selective``, ``every_n_layers``, ``offload``, ...):
    anything beyond what TRL writes itself."""
    keys: set[str] = set()
    for name in _KWARGS:
        value = getattr(args, name, None)
        if isinstance(value, dict):
            keys.update(k for k in value if k not in _SET_BY_TRL)
    return sorted(keys)


def checkpointing_by_default(args: Any) -> bool:
    """Whether the run's own activation checkpointing is on only because the arguments' class
    defaults to it (TRL's `SFTConfig`: ``gradient_checkpointing=True``) and nothing else about it
    was configured. A value equal to the class default cannot be told apart from one the user
    typed: ``SFTConfig(gradient_checkpointing=True)`` reads as the default."""
    return checkpointing_on(args) and _default_on(type(args)) and not _configured(args)


def explicit_checkpointing_error(args: Any) -> AdaccError:
    """The error for arguments that ask for transformers' own checkpointing explicitly."""
    kwargs = _configured(args)
    what = (
        f"activation_checkpointing_kwargs with {', '.join(kwargs)}"
        if kwargs
        else "activation_checkpointing=True / gradient_checkpointing=True"
    )
    return AdaccError(
        f"adacc replaces activation checkpointing, but the run's arguments ask for transformers' "
        f"own ({what}): pass activation_checkpointing=False (gradient_checkpointing=False before "
        "transformers 5.23) and no checkpointing kwargs, or drop adacc to keep transformers' "
        "checkpointing"
    )


def switch_off_own_checkpointing(args: Any, model: Any = None, *, peft_hooks: bool = False) -> None:
    """Undo transformers' (and TRL's) activation checkpointing so adacc can install its own:
    both flags off in `args`; on `model`, checkpointing disabled where it is on, and the
    embedding hooks that make inputs require gradients (``enable_input_require_grads``) removed
    where checkpointing added them: `activation_checkpointing_enable` adds them (replacing any
    earlier list) for models taking ``input_ids``; TRL adds them to a PEFT model before the
    Trainer exists (`peft_hooks`). Adacc's checkpoint is non-reentrant and needs none of them."""
    for name in _FLAGS:
        if hasattr(args, name):
            setattr(args, name, False)
    if model is None:
        return
    base = unwrap_model(model)
    was_on = any(getattr(m, "gradient_checkpointing", False) is True for m in base.modules())
    if was_on:
        off = getattr(base, "activation_checkpointing_disable", None)
        (off or base.gradient_checkpointing_disable)()
    if (was_on or peft_hooks) and getattr(base, "_require_grads_hooks", None):
        base.disable_input_require_grads()


def flattens_batches(args: Any, collator: Any = None) -> bool:
    """Whether the run's batches are padding-free: the micro-batch's rows flattened into one row of
    all their tokens (TRL's ``padding_free`` and BFD packing, `DataCollatorWithFlattening`)."""
    if getattr(collator, "padding_free", False):
        return True
    if type(collator).__name__ == "DataCollatorWithFlattening":
        return True
    if getattr(args, "padding_free", False):
        return True
    return bool(getattr(args, "packing", False)) and getattr(args, "packing_strategy", None) in (
        "bfd",
        "bfd_split",
    )


def longest_sequence(args: Any, collator: Any = None, dataset: Any = None) -> int | None:
    """The run's longest batch length, where the run says it: TRL's ``max_length`` /
    ``max_seq_length`` (with packing: the packed rows' length), a collator padding to
    ``max_length``, or the longest ``input_ids`` of a (pre-tokenised, not too large) training
    dataset. Padding-free batches are one row of the micro-batch's tokens: up to
    ``per_device_train_batch_size`` times that. None when nothing says it (each new length is then
    planned when it first comes)."""
    n = _longest_row(args, collator, dataset)
    if n is not None and flattens_batches(args, collator):
        n *= max(1, int(getattr(args, "per_device_train_batch_size", 1) or 1))
    return n


def _longest_row(args: Any, collator: Any, dataset: Any) -> int | None:
    for name in ("max_length", "max_seq_length"):
        n = getattr(args, name, None)
        if isinstance(n, int) and n > 0:
            return n
    n = getattr(collator, "max_length", None)
    if isinstance(n, int) and n > 0 and getattr(collator, "padding", None) == "max_length":
        return n
    try:
        if dataset is not None and 0 < len(dataset) <= SCAN_ROWS:
            names = getattr(dataset, "column_names", None)
            if names is not None and "input_ids" in names:
                return max(len(r) for r in dataset["input_ids"]) or None
    except Exception:  # an iterable or unusual dataset: nothing to read
        return None
    return None


def batches_fetched_ahead(loader: Any) -> int:
    """Batches `loader` holds beside the one it yields: accelerate's loaders (every Trainer's,
    TRL's included, and any ``accelerator.prepare``d one) fetch the next batch from the loader they
    wrap before yielding the current one, to know whether it is the last; the dispatcher does so
    on the main process only, a whole dispatched batch (every process's micro-batch) unless it
    splits batches. 0 for any other loader."""
    try:
        from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard
    except ImportError:  # pragma: no cover - transformers' Trainer needs accelerate
        return 0
    if isinstance(loader, DataLoaderShard):
        return 1
    if isinstance(loader, DataLoaderDispatcher):
        state = loader.state
        if state.process_index != 0:
            return 0
        return 1 if loader.split_batches else max(1, int(state.num_processes))
    return 0


def trl_fused_head(model: Any) -> bool:
    """Whether TRL's fused LM head owns the model's forward (`SFTTrainer` patches it onto the
    instance: with ``fused_lm_head=True`` the loss is computed chunk by chunk from the final hidden
    states, and the ``[tokens x vocab]`` logits never exist)."""
    base = unwrap_model(model)
    # Accelerate's mixed precision wraps the forward again (keeping ``_original_forward``); TRL
    # wraps it with functools.wraps (the model class's name and module): ask where each lives.
    todo = [base.__dict__.get("forward"), base.__dict__.get("_original_forward")]
    seen: set[int] = set()
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        module = getattr(fn, "__globals__", {}).get("__name__", "")
        if module.split(".")[0] == "trl":
            return True
        todo += [getattr(fn, "__func__", None), getattr(fn, "__wrapped__", None)]
    return False


def _head_note(model: Any, what: str) -> str | None:
    """Why adacc's chunked head (asked for by `what`) stands down or cannot apply: a note to log
    where TRL's fused head already chunks the loss (returned), an `AdaccError` where the model
    cannot take it otherwise, None where it applies."""
    problem = chunked_head_problem(model)
    if problem is None:
        return None
    if trl_fused_head(model):
        return (
            f"adacc: {what}: TRL's fused LM head already computes the loss chunk by chunk without "
            "the logits, so adacc's chunked head stands down and TRL's runs (head='full': the "
            "model's own forward)"
        )
    raise AdaccError(f"adacc {what}: the chunked LM head does not apply to this model: {problem}")


def run_config(config: AdaccConfig, args: TrainingArguments) -> AdaccConfig:
    """`config` with what the run decides filled in from its arguments: the optimizer (and the
    Trainer's fp32 embedding states under 8-bit ones), mixed precision, world size and sharding
    (per-device budgets divide sharded states)."""
    mp = (
        "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    )
    fields = {
        "optimizer": str(getattr(args.optim, "value", args.optim)),
        "fp32_embeddings": True,  # the Trainer's bitsandbytes override (`estimate_static_memory`)
        "mixed_precision": mp,
        "gradient_accumulation_steps": max(1, int(getattr(args, "gradient_accumulation_steps", 1))),
        "world_size": max(1, int(getattr(args, "world_size", 1) or 1)),
        **sharding_from_trainer(args),
    }
    return dataclasses.replace(config, **fields)


class AdaccCallback(TrainerCallback):
    """Applies Adacc inside any `Trainer`: profiles the first training batch, solves, patches the
    model, runs the rectifier on tracking steps, saves the policy with every checkpoint, restores it
    on resume and undoes everything when training ends.

    ``AdaccCallback(config)`` or ``AdaccCallback(budget="20GiB", ...)`` (any `AdaccConfig` field);
    ``policy`` reuses a saved policy (object or ``adacc_policy.json`` path). With neither, the
    options come from `AdaccTrainingArguments` when the run uses them.
    """

    def __init__(
        self,
        config: AdaccConfig | None = None,
        *,
        policy: Policy | str | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise AdaccError("give AdaccCallback either a config or options, not both")
        self.config = AdaccConfig(**options) if options else config
        self.policy = Policy.load(policy) if isinstance(policy, str) else policy
        self.session: AdaccSession | None = None
        self.resume_dir: str | None = None  # set by AdaccTrainer; else found from the state
        self.batch_choice: Any = None  # `autobatch.BatchChoice`, set by AdaccTrainer

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

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        # A callback added after the Trainer was built: `train()` has enabled checkpointing.
        self._take_over(args, model, peft_hooks=False)
        base = unwrap_model(model)
        owner = base.__dict__.get("_adacc_session")
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
            self.session.check_oom()
            reserve = self.session.oom_reserve_nbytes
            self.session.close()
        config = run_config(self._config(args), args)
        if config.head == "chunked" and (note := _head_note(model, "head='chunked'")):
            logger.info(note)
            config = dataclasses.replace(config, head="full")
        if (
            policy is not None
            and policy.head == "chunked"
            and (note := _head_note(model, "the policy's head='chunked'"))
        ):
            logger.info(note)
            policy = dataclasses.replace(policy, head="full")
        choice = self.batch_choice
        if config.auto_batch_size and choice is None and policy is None:
            raise AdaccError(
                "adacc auto_batch_size needs AdaccTrainer: a plain Trainer builds its data loader "
                "before callbacks run, so the micro-batch cannot change there"
            )
        loader = kwargs.get("train_dataloader")
        if config.max_seq_len is None:
            collate = getattr(loader, "collate_fn", None)
            collate = getattr(collate, "data_collator", collate)  # Trainer's column remover
            longest = longest_sequence(args, collate, getattr(loader, "dataset", None))
            if longest is not None:
                config = dataclasses.replace(config, max_seq_len=longest)
        saved: tuple[list[Profile], str] | None = None
        if config.profile_from is None:  # an earlier run of this one saved its profiles here
            found = ((read_profiles(d, strict=False), d) for d in (resume, args.output_dir) if d)
            saved = next(((p, d) for p, d in found if p), None)
        if choice is not None and policy is None:  # AdaccTrainer's automatic micro-batch
            policy, profile = choice.policy, choice.profile
        self.session = AdaccSession(
            model,
            config,
            policy=policy,
            profile=profile if policy else None,
            profiles=dict(choice.profiles) if choice is not None else None,
        )
        if choice is not None:
            self.session.micro_batch, self.session.accumulation = (
                choice.micro_batch,
                choice.accumulation,
            )
            self.session.batch_choice = choice
            self.session.events.append(choice.event())
        if saved is not None:
            self.session.reuse_profiles(*saved)
        if sched:
            self.session.restore_schedule(sched)
        self.session.loader_ahead = batches_fetched_ahead(loader)  # alive beside each step's
        self.session.oom_reserve_nbytes = reserve  # what the device showed it does not hold
        self.session.attach()
        trainer = find_trainer()  # an out-of-memory step is re-planned and re-run (`retry`)
        if trainer is not None:
            wrap_trainer(trainer, lambda: self.session, getattr(trainer, "_log_adacc_events", None))
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
