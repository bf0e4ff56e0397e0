"""`RunFacts`: what the run decides (its optimizer, mixed precision, accumulation, sharding).

They are not options: each entry point reads them off the run it joins. The Trainer ones from its
`TrainingArguments` (`RunFacts.from_training_args`), `prepare` from the model, the optimizer the
loop steps, an initialised ``Accelerator`` and the process group (`RunFacts.from_loop`); the
autocast a training forward runs under is read when it starts (`detect_autocast`). ``run=`` states
what cannot be read off the run.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import AdaccError, AdaccFutureWarning
from ..solver.static import optimizer_name
from .sharding import sharding_from_model, sharding_from_trainer

__all__ = [
    "MIXED_PRECISION_DTYPES",
    "RunFacts",
    "accelerate_accumulation",
    "detect_autocast",
    "loop_facts",
    "warn_future",
]

MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: The facts that are `solver.estimate_static_memory` options of the same name.
STATIC_OPTIONS = (
    "optimizer",
    "mixed_precision",
    "zero_stage",
    "fsdp",
    "world_size",
    "offload_optimizer",
    "master_weights",
    "fp32_embeddings",
    "ddp",
    "zero_buckets",
)
#: Given any of these as keywords, `prepare` reads no sharding off the model (the old way).
SHARDING_FACTS = frozenset({"zero_stage", "fsdp", "world_size", "offload_optimizer"})


@dataclass(frozen=True)
class RunFacts:
    """The facts of the run a session plans for: what counts in the step's static memory.

    Each entry point derives them (module docstring); pass ``run=RunFacts(...)`` to `prepare`
    or `AdaccConfig` for what it cannot read (a model sharded later, an accumulation the loop
    does by hand). In the Trainer what its arguments say replaces these, the rest stands.

    Attributes:
        optimizer (str, default ``"adamw_torch"``): the optimizer whose states count in the
            static memory: a name of `solver.static.KNOWN_OPTIMIZERS`, as
            ``TrainingArguments.optim`` names it. Read off ``args.optim`` in the Trainer and off
            the optimizer object `prepare` is given.
        fp32_embeddings (bool, default False): 8-bit bitsandbytes optimizers keep
            ``nn.Embedding`` states in fp32: the Trainer registers that override (True there); a
            custom loop's optimizer has it only if it asks.
        mixed_precision (str | None, default None): ``"bf16"`` / ``"fp16"``: forwards autocast
            to it; None or ``"no"``: none known (the autocast of the first training forward is
            read then: `detect_autocast`). The Trainer's ``--bf16`` / ``--fp16``.
        gradient_accumulation_steps (int, default 1): micro-batches per optimizer step (>= 1);
            gradients stay alive through every micro-batch but the first. The Trainer's
            argument; for `prepare` its keyword, else an initialised ``Accelerator``'s.
        zero_stage (int, default 0): the DeepSpeed ZeRO stage (0-3) sharding the static memory
            over `world_size` ranks (`estimate_static_memory`).
        fsdp (bool, default False): FSDP full shard: parameters, gradients and optimizer states
            sharded over `world_size` ranks.
        world_size (int, default 1): the ranks the model is sharded or replicated over (>= 1).
        offload_optimizer (bool, default False): optimizer states and master weights are kept
            off the device.
        master_weights (bool, default False): fp32 copies of 16-bit parameters (DeepSpeed mixed
            precision).
        ddp (bool, default False): replicated by DDP: its gradient buckets count
            (`solver.static`).
        zero_buckets (int | None, default None): ZeRO-2: the gradient elements its reduce
            buckets hold through backward (``reduce_bucket_size``, twice with
            ``overlap_comm``; 0 without ``contiguous_gradients``); None: "auto"
            (hidden_size**2, counted twice).

    Raises:
        AdaccError: a ZeRO stage, mixed precision, accumulation, world size or bucket size out
            of range.

    Example:
        >>> RunFacts(zero_stage=3, world_size=8, mixed_precision="bf16").autocast
        torch.bfloat16
    """

    optimizer: str = "adamw_torch"
    fp32_embeddings: bool = False
    mixed_precision: str | None = None
    gradient_accumulation_steps: int = 1
    zero_stage: int = 0
    fsdp: bool = False
    world_size: int = 1
    offload_optimizer: bool = False
    master_weights: bool = False
    ddp: bool = False
    zero_buckets: int | None = None

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise AdaccError(f"zero_stage must be 0-3, got {self.zero_stage}")
        if self.mixed_precision not in (None, "no", *MIXED_PRECISION_DTYPES):
            raise AdaccError(
                f"mixed_precision must be 'bf16', 'fp16', 'no' or None, not {self.mixed_precision!r}"
            )
        if self.gradient_accumulation_steps < 1:
            raise AdaccError("gradient_accumulation_steps must be >= 1")
        if self.world_size < 1:
            raise AdaccError(f"world_size must be >= 1, got {self.world_size}")
        if self.zero_buckets is not None and (
            isinstance(self.zero_buckets, bool)
            or not isinstance(self.zero_buckets, int)
            or self.zero_buckets < 0
        ):
            raise AdaccError(
                "zero_buckets (ZeRO-2's reduce-bucket elements) must be an int >= 0 or None "
                f"(read from the DeepSpeed config), got {self.zero_buckets!r}"
            )

    def static_options(self) -> dict[str, Any]:
        """The `solver.estimate_static_memory` options of this run.

        Returns:
            The facts of `STATIC_OPTIONS` by name.
        """
        return {name: getattr(self, name) for name in STATIC_OPTIONS}

    @property
    def autocast(self) -> torch.dtype | None:
        """The dtype forwards autocast to (None: no mixed precision known)."""
        return MIXED_PRECISION_DTYPES.get(self.mixed_precision or "")

    @classmethod
    def from_training_args(cls, args: Any, base: RunFacts | None = None) -> RunFacts:
        """What a `TrainingArguments` run decides: its optimizer (and the Trainer's fp32
        embedding states under 8-bit ones), mixed precision, accumulation, world size and
        sharding (DeepSpeed config, FSDP options or Accelerate's launch config).

        Args:
            args: the run's `TrainingArguments` (any object with their attributes).
            base: the facts the arguments do not say (default: `RunFacts()`'s).

        Returns:
            `base` with what `args` say.
        """
        mp = (
            "bf16"
            if getattr(args, "bf16", False)
            else "fp16"
            if getattr(args, "fp16", False)
            else None
        )
        optim = getattr(args, "optim", "adamw_torch")
        said = {
            "optimizer": str(getattr(optim, "value", optim)),
            "fp32_embeddings": True,  # the Trainer's bitsandbytes override (`estimate_static_memory`)
            "mixed_precision": mp,
            "gradient_accumulation_steps": max(
                1, int(getattr(args, "gradient_accumulation_steps", 1))
            ),
            "world_size": max(1, int(getattr(args, "world_size", 1) or 1)),
            **sharding_from_trainer(args),
        }
        return dataclasses.replace(base or cls(), **said)

    @classmethod
    def from_loop(
        cls,
        model: torch.nn.Module,
        optimizer: Any = None,
        gradient_accumulation_steps: int | None = None,
        *,
        sharding: bool = True,
        base: RunFacts | None = None,
    ) -> RunFacts:
        """What a custom loop's run shows: the optimizer's name (`solver.static.optimizer_name`),
        the accumulation (given, else an initialised ``Accelerator``'s), DDP and sharding read off
        the model and the process group (`sharding.sharding_from_model`). Mixed precision is read
        off the first training forward (`detect_autocast`), not here.

        Args:
            model: the model the loop trains (or its wrapper: DDP, DeepSpeed, FSDP2, PEFT).
            optimizer: the optimizer the loop steps, or its name (None: ``"adamw_torch"``).
            gradient_accumulation_steps: micro-batches per optimizer step (None: read off
                Accelerate, else 1).
            sharding: read the sharding off the model (False: a single unsharded process).
            base: the facts the user stated: nothing is read off the run then, `optimizer` and
                `gradient_accumulation_steps` (where given) replace theirs.

        Returns:
            The facts of this run.
        """
        found: dict[str, Any] = {}
        if base is None and sharding:
            found.update(sharding_from_model(model))
        if optimizer is not None:
            found["optimizer"] = (
                optimizer if isinstance(optimizer, str) else optimizer_name(optimizer)
            )
        if gradient_accumulation_steps is None and base is None:
            gradient_accumulation_steps = accelerate_accumulation()
        if gradient_accumulation_steps is not None:
            found["gradient_accumulation_steps"] = gradient_accumulation_steps
        return dataclasses.replace(base or cls(), **found)


#: The facts by name (`RunFacts`'s fields).
FACTS = tuple(f.name for f in dataclasses.fields(RunFacts))


def accelerate_accumulation() -> int | None:
    """The gradient accumulation of an initialised ``Accelerator`` (its ``GradientState``), or
    None where none was made in this process."""
    try:
        from accelerate.state import GradientState, is_initialized
    except ImportError:  # pragma: no cover - Accelerate is optional here
        return None
    if not is_initialized() or GradientState._shared_state == {}:
        return None  # (building GradientState() would initialise it)
    return max(1, int(GradientState().num_steps))


def detect_autocast(
    device: torch.device, model: torch.nn.Module | None = None
) -> torch.dtype | None:
    """The autocast a training forward will run under: an autocast region the caller entered,
    or an ``Accelerator``'s mixed precision where `model`'s forward is Accelerate's (its
    ``prepare`` wraps ``model.forward`` in autocast, which starts after the pre-hooks run). With
    no `model` (no forward yet: `prepare` with a `sample_batch`, possibly before
    ``accelerator.prepare``) an initialized ``Accelerator``'s mixed precision is the guess; the
    first training forward corrects it (`Planner.follow_autocast`)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    if model is not None and not hasattr(model, "_original_forward"):
        return None
    try:
        from accelerate.state import AcceleratorState, is_initialized
    except ImportError:  # pragma: no cover
        return None
    if is_initialized():
        return MIXED_PRECISION_DTYPES.get(str(AcceleratorState().mixed_precision))
    return None


def loop_facts(
    model: torch.nn.Module,
    optimizer: Any,
    accumulation: int | None,
    run: RunFacts | None,
    options: Mapping[str, Any],
) -> RunFacts:
    """The facts a custom loop (`prepare`) plans with: `run`, else read off the loop
    (`RunFacts.from_loop`); what the loop tells (`optimizer`, `accumulation`) over them; facts
    given by name among `options` (the old way, warned) over everything.

    Args:
        model: the model the loop trains (or its wrapper).
        optimizer: the optimizer the loop steps, or its name (None: unknown).
        accumulation: micro-batches per optimizer step (None: read off Accelerate, else 1).
        run: the facts the user stated (None: read them).
        options: `prepare`'s options by name; those naming a fact count as facts.

    Raises:
        AdaccError: a fact given both in `run` and by name.
    """
    named = {k: v for k, v in options.items() if k in FACTS}
    warn_facts(named)
    if run is not None and named:
        raise AdaccError(f"{', '.join(named)} given both in run= and by name: give them in run=")
    shard = not named.keys() & SHARDING_FACTS  # sharding given by name: none read
    run = RunFacts.from_loop(model, optimizer, accumulation, sharding=shard, base=run)
    return dataclasses.replace(run, **named)


def warn_facts(names: Iterable[str]) -> None:
    """The one-release warning for facts of the run passed as options by their flat names."""
    names = list(names)
    if not names:
        return
    what = f"{names[0]} is a fact" if len(names) == 1 else f"{', '.join(names)} are facts"
    given = ", ".join(f"{n}=..." for n in names)
    warn_future(
        f"{what} of the run, not options: prepare and the Trainer read them off the run (the "
        "optimizer object, TrainingArguments, Accelerate, the model's sharding); to state them "
        f"yourself pass run=RunFacts({given}). Passing them by name goes in the next release"
    )


def warn_future(message: str) -> None:
    """`AdaccFutureWarning` with `message`, pointing at the first caller outside adacc_hf."""
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("adacc_hf"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, AdaccFutureWarning, stacklevel=level)
