"""What adacc reads off a Trainer run: its activation checkpointing flags (and taking them over),
its longest batch, TRL's fused LM head, and the facts of the run an `AdaccConfig` is completed with
(`run_config`, through `RunFacts.from_training_args`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from transformers import TrainingArguments

from ..adapters import unwrap_model
from ..engine.config import AdaccConfig
from ..engine.facts import RunFacts
from ..errors import AdaccError
from ..runtime.head import chunked_head_problem

logger = logging.getLogger("adacc_hf")

__all__ = [
    "batches_fetched_ahead",
    "checkpointing_by_default",
    "checkpointing_on",
    "checkpointing_typed",
    "explicit_checkpointing_error",
    "flattens_batches",
    "head_note",
    "longest_sequence",
    "run_config",
    "switch_off_own_checkpointing",
    "trl_fused_head",
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


def checkpointing_typed(args: Any) -> bool:
    """Whether the user turned transformers' own checkpointing on (either name, any value other
    than the class's field default), read before `TrainingArguments.__post_init__` copies one name
    onto the other."""
    fields = {f.name for f in dataclasses.fields(args)}
    return any(
        name in fields
        and (value := getattr(args, name, None))
        and value != _field_default(type(args), name)
        for name in _FLAGS
    )


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


def head_note(model: Any, what: str) -> str | None:
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
    """`config` with the facts of the run its arguments say (`RunFacts.from_training_args`: the
    optimizer, mixed precision, accumulation, world size and sharding) over ``config.run``'s.

    Args:
        config: the run's options.
        args: the run's `TrainingArguments`.

    Returns:
        The config the session plans with.
    """
    return config.with_run(RunFacts.from_training_args(args, base=config.run))
