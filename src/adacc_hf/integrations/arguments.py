"""`AdaccTrainingArguments`: `TrainingArguments` plus Adacc's options (``--adacc ...``)."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..engine.config import AdaccConfig
from ..errors import AdaccError, PolicyError
from ..policy import Policy
from ..solver import MAX_GRAD_ERROR
from .callback import AdaccCallback
from .run_facts import (
    checkpointing_by_default,
    checkpointing_on,
    checkpointing_typed,
    explicit_checkpointing_error,
    switch_off_own_checkpointing,
)

__all__ = ["INTEGRATION", "AdaccTrainingArguments"]

logger = logging.getLogger("adacc_hf")

#: The `report_to` name under which `AdaccTrainingArguments(adacc=True)` reaches a plain Trainer.
INTEGRATION = "adacc"
#: Old option names (one release): each is its `AdaccConfig` field's name after ``adacc_`` now.
RENAMED = {"adacc_memory_budget": "adacc_budget", "adacc_profile": "adacc_profile_from"}


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class AdaccTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus Adacc's options (``--adacc ...`` on the command line).

    With ``adacc=True`` a plain `Trainer` profiles the first batch, solves the per-op policy for
    the budget and trains with it (`AdaccCallback`, added through ``report_to``, which wires the
    rest into the Trainer: `wiring`). Every option is named ``adacc_`` + its `AdaccConfig`
    field's name. Every other argument is
    `TrainingArguments`'. The ``adacc_*`` options become an `AdaccConfig` (`adacc_config`); each
    has the same text as ``help`` for ``--help``. Without ``adacc=True`` they are ignored (with a
    warning). With it, Adacc replaces activation checkpointing: checkpointing that the arguments'
    class turns on by default (TRL's configs) is switched off, and ``ddp_find_unused_parameters``
    defaults to False.

    Attributes:
        adacc: train with Adacc: per-op retain / compress / recompute of activations under a
            budget.
        adacc_budget: device memory budget per GPU: ``"20GiB"``, ``"20GB"``, ``"80%"`` of
            device memory, a byte count, or ``"auto"`` (free memory plus what the model already
            holds, minus max(1 GiB, 5%)).
        adacc_policy: a saved ``adacc_policy.json`` to reuse: skips profiling and solving.
        adacc_profile_from: saved profiles to plan from where they match this run (model, dtype,
            device, versions, bucket): an ``adacc_profiles.json`` or a directory holding one.
            Default: ``output_dir``'s (or the resumed checkpoint's); ``"none"``: always profile.
        adacc_codecs: codecs the solver may use (default: each layer type's own codec), e.g.
            ``--adacc_codecs int4_outlier int4_channel int4_asym bitpack`` (or one
            comma-separated string).
        adacc_zscore_threshold: z-score above which a channel is an outlier kept exact by
            ``int4_outlier``.
        adacc_adaptive: re-measure codec ratios and errors during training (1, 2, 4, ... steps
            apart) and switch policy when the optimum changes.
        adacc_max_tracking_interval: largest number of steps between two tracking steps.
        adacc_max_codec_error: a codec whose relative error on an op exceeds this is not used for
            that op.
        adacc_max_grad_error: largest relative error of a block's gradients the codecs may cause,
            their measured effects added in quadrature (0: no lossy codec; a negative value: no
            bound).
        adacc_solver: MILP solver: ``"cbc"`` or ``"highs"``.
        adacc_solver_time_limit: seconds the MILP solver may search; then its best policy so far
            is used (with a warning). If it has none, or the solver fails, full recomputation is
            used.
        adacc_split_blocks: let blocks run different policies (some without checkpointing) to
            fill the budget.
        adacc_head: how a causal LM's head and loss run: ``"full"`` (the model's own logits),
            ``"chunked"`` (the loss chunk by chunk: the [tokens x vocab] logits never exist and
            training forwards return ``logits=None``) or ``"auto"`` (the solver picks the fastest
            that fits).
        adacc_offload: let the solver hold op outputs and block inputs in host memory until
            backward (offload, as they are or compressed first), copied on a side stream and
            brought back one block ahead. Default: on CUDA devices; True also on CPU (a stand-in
            host, for tests); False: never.
        adacc_offload_host_cap: host memory offload may hold: bytes, ``"16GiB"`` or ``"50%"`` of
            the host's memory (default: half the host memory available when the first plan is
            made).
        adacc_max_seq_len: the longest sequence of the run. Its bucket is planned before the
            first step, so a budget too small for it fails at once (default: read from TRL's
            ``max_length``, a collator padding to a fixed length or the dataset where they say
            it; else each bucket is planned when its first batch comes).
        adacc_auto_batch_size: pick the micro-batch with the best predicted tokens/s whose step
            fits the budget, keeping the global batch (``per_device_train_batch_size`` x
            ``gradient_accumulation_steps``) by adjusting accumulation (planned in the Trainer's
            ``train`` before the data loader is built: `wiring`).
        adacc_expandable_segments: on CUDA, turn on the allocator's expandable segments unless
            ``PYTORCH_CUDA_ALLOC_CONF`` is set: without them a step reserves well above what it
            allocates (1.4 GiB over a 6 GiB step measured on an H100), and CUDA runs out when
            reserved memory does.
        adacc_codec_backends: codec implementations timed on each op, the fastest used
            (``torch``, ``inductor``, ``triton``, ``bitsandbytes``, ``torchao``; None: every one
            on CUDA, the reference elsewhere).
        adacc_memory_budget: deprecated name of ``adacc_budget`` (one release, with a warning).
        adacc_profile: deprecated name of ``adacc_profile_from`` (one release, with a warning).
        adacc_allocator: the caching allocator each plan's reserved peak is fitted to before
            its step runs: ``auto`` (CUDA's, as configured), ``expandable``, ``default``, ``off``.

    Raises:
        AdaccError: with ``adacc=True``: an option Adacc cannot take (a malformed budget, a
            policy file that does not load, an unknown codec, ...), or activation checkpointing
            the user turned on (``--gradient_checkpointing``, checkpointing kwargs,
            ``fsdp_config["activation_checkpointing"]``), which Adacc replaces.
    """

    adacc: bool = field(
        default=False,
        metadata=_help(
            "Train with Adacc: per-op retain / compress / recompute of activations under a budget."
        ),
    )
    adacc_budget: str = field(
        default="auto",
        metadata=_help(
            "Device memory budget per GPU: '20GiB', '20GB', '80%' of device memory, a byte count, "
            "or 'auto' (free memory plus what the model already holds, minus max(1 GiB, 5%))."
        ),
    )
    adacc_policy: str | None = field(
        default=None,
        metadata=_help("A saved adacc_policy.json to reuse: skips profiling and solving."),
    )
    adacc_profile_from: str | None = field(
        default=None,
        metadata=_help(
            "Saved profiles to plan from where they match this run (model, dtype, device, "
            "versions, bucket): an adacc_profiles.json or a directory holding one. Default: "
            "output_dir's (or the resumed checkpoint's); 'none': always profile."
        ),
    )
    adacc_codecs: list[str] | None = field(
        default=None,
        metadata=_help(
            "Codecs the solver may use (default: each layer type's own codec), e.g. "
            "--adacc_codecs int4_outlier int4_channel int4_asym bitpack."
        ),
    )
    adacc_zscore_threshold: float = field(
        default=3.0,
        metadata=_help("Z-score above which a channel is an outlier kept exact by int4_outlier."),
    )
    adacc_adaptive: bool = field(
        default=True,
        metadata=_help(
            "Re-measure codec ratios and errors during training (1, 2, 4, ... steps apart) and "
            "switch policy when the optimum changes."
        ),
    )
    adacc_max_tracking_interval: int = field(
        default=1024, metadata=_help("Largest number of steps between two tracking steps.")
    )
    adacc_max_codec_error: float = field(
        default=0.5,
        metadata=_help(
            "A codec whose relative error on an op exceeds this is not used for that op."
        ),
    )
    adacc_max_grad_error: float | None = field(
        default=MAX_GRAD_ERROR,
        metadata=_help(
            "Largest relative error of a block's gradients the codecs may cause, their measured "
            "effects added in quadrature (0: no lossy codec; a negative value: no bound)."
        ),
    )
    adacc_solver: str = field(default="cbc", metadata=_help("MILP solver: 'cbc' or 'highs'."))
    adacc_solver_time_limit: float = field(
        default=10.0,
        metadata=_help(
            "Seconds the MILP solver may search; then its best policy so far is used (with a "
            "warning). If it has none, or the solver fails, full recomputation is used."
        ),
    )
    adacc_split_blocks: bool = field(
        default=True,
        metadata=_help(
            "Let blocks run different policies (some without checkpointing) to fill the budget."
        ),
    )
    adacc_head: str = field(
        default="full",
        metadata=_help(
            "How a causal LM's head and loss run: 'full' (the model's own logits), 'chunked' "
            "(the loss chunk by chunk: the [tokens x vocab] logits never exist and training "
            "forwards return logits=None) or 'auto' (the solver picks the fastest that fits)."
        ),
    )
    adacc_offload: bool | None = field(
        default=None,
        metadata=_help(
            "Let the solver hold op outputs and block inputs in host memory until backward "
            "(offload, as they are or compressed first), copied on a side stream and brought back "
            "one block ahead. Default: on CUDA devices; True also on CPU (a stand-in host, for "
            "tests); False: never."
        ),
    )
    adacc_offload_host_cap: str | None = field(
        default=None,
        metadata=_help(
            "Host memory offload may hold: bytes, '16GiB' or '50%' of the host's memory "
            "(default: half the host memory available when the first plan is made)."
        ),
    )
    adacc_max_seq_len: int | None = field(
        default=None,
        metadata=_help(
            "The longest sequence of the run. Its bucket is planned before the first step, so a "
            "budget too small for it fails at once (default: read from TRL's max_length, a "
            "collator padding to a fixed length or the dataset where they say it; else each "
            "bucket is planned when its first batch comes)."
        ),
    )

    adacc_auto_batch_size: bool = field(
        default=False,
        metadata=_help(
            "Pick the micro-batch with the best predicted tokens/s whose step fits the budget, "
            "keeping the global batch (per_device_train_batch_size x gradient_accumulation_steps) "
            "by adjusting accumulation (planned before the Trainer builds its data loader)."
        ),
    )

    adacc_expandable_segments: bool = field(
        default=True,
        metadata=_help(
            "On CUDA, turn on the allocator's expandable segments unless PYTORCH_CUDA_ALLOC_CONF "
            "is set: without them a step reserves well above what it allocates (1.4 GiB over a "
            "6 GiB step measured on an H100), and CUDA runs out when reserved memory does."
        ),
    )

    adacc_allocator: str = field(
        default="auto",
        metadata=_help(
            "The caching allocator each plan's reserved peak is fitted to before its step runs "
            "(its step run dry on a host mirror of the model): auto (CUDA's, as configured; none "
            "elsewhere), expandable, default, off (the guard alone re-plans after a step)."
        ),
    )
    adacc_codec_backends: list[str] | None = field(
        default=None,
        metadata=_help(
            "Codec implementations timed on each op, the fastest used: torch, inductor, triton, "
            "bitsandbytes, torchao (default: every one on CUDA, the reference elsewhere)."
        ),
    )
    # old names, kept for one release (`RENAMED`)
    adacc_memory_budget: str | None = field(
        default=None, metadata=_help("Deprecated: --adacc_budget.")
    )
    adacc_profile: str | None = field(
        default=None, metadata=_help("Deprecated: --adacc_profile_from.")
    )

    def _take_renamed(self) -> None:
        """Old option names fill the new ones, with a warning (both given: an error)."""
        for old, new in RENAMED.items():
            value = getattr(self, old)
            if value is None:
                continue
            default = next(f.default for f in dataclasses.fields(self) if f.name == new)
            if getattr(self, new) not in (default, value):
                raise AdaccError(f"{old} is the old name of {new}: give only {new}")
            warnings.warn(
                f"{old} is renamed {new} (the AdaccConfig field's name); the old name goes in "
                "the next release",
                FutureWarning,
                stacklevel=4,
            )
            setattr(self, new, value)
            setattr(self, old, None)

    def __post_init__(self) -> None:
        self._take_renamed()
        if self.adacc_codecs is not None:  # also "a,b" (a YAML string, older command lines)
            items = [self.adacc_codecs] if isinstance(self.adacc_codecs, str) else self.adacc_codecs
            self.adacc_codecs = [c.strip() for i in items for c in str(i).split(",") if c.strip()]
        typed = checkpointing_typed(self)  # before the parent resolves the two names
        super().__post_init__()
        if not self.adacc:
            given = [
                f.name
                for f in dataclasses.fields(self)
                if f.name.startswith("adacc_") and getattr(self, f.name) != f.default
            ]
            if given:
                logger.warning(
                    "adacc options given without adacc=True (%s): Adacc is off for this run; "
                    "add --adacc (adacc=True) to use them",
                    ", ".join(given),
                )
            return
        if checkpointing_on(self):
            if typed:
                raise AdaccError(
                    "adacc replaces activation checkpointing: drop --gradient_checkpointing / "
                    "--activation_checkpointing (or set adacc=False)"
                )
            if not checkpointing_by_default(self):  # checkpointing kwargs set by the user
                raise explicit_checkpointing_error(self)
            switch_off_own_checkpointing(self)
            logger.info(
                "adacc takes over activation checkpointing: %s turns gradient_checkpointing on "
                "by default, so the run's own is switched off and adacc's per-op policy "
                "replaces it",
                type(self).__name__,
            )
        fsdp_config = getattr(self, "fsdp_config", None) or {}
        if fsdp_config.get("activation_checkpointing"):
            raise AdaccError(
                "fsdp_config['activation_checkpointing'] (FSDP's own checkpointing) cannot be "
                "combined with adacc: remove it from fsdp_config"
            )
        from ..solver import parse_budget

        try:
            parse_budget(self.adacc_budget, "cpu")  # syntax check before any work
        except Exception as e:
            raise AdaccError(f"adacc_budget: {e}") from None
        if self.adacc_policy is not None:
            try:
                Policy.load(self.adacc_policy)
            except PolicyError as e:
                raise AdaccError(f"adacc_policy: {e}") from None
        self.adacc_config()  # validates codecs and intervals
        if self.ddp_find_unused_parameters is None:
            # Checkpointed blocks re-run in backward; DDP must not look for unused parameters.
            self.ddp_find_unused_parameters = False
        _enable_integration(self)

    def adacc_config(self) -> AdaccConfig:
        """The `AdaccConfig` these options describe (run-dependent fields: see `run_config`)."""
        return AdaccConfig(
            budget=self.adacc_budget,
            codecs=list(self.adacc_codecs) if self.adacc_codecs else None,
            zscore_threshold=self.adacc_zscore_threshold,
            adaptive=self.adacc_adaptive,
            max_tracking_interval=self.adacc_max_tracking_interval,
            solver=self.adacc_solver,
            solver_time_limit=self.adacc_solver_time_limit,
            max_codec_error=self.adacc_max_codec_error,
            max_grad_error=(
                None
                if self.adacc_max_grad_error is None or self.adacc_max_grad_error < 0
                else self.adacc_max_grad_error
            ),
            split_blocks=self.adacc_split_blocks,
            head=self.adacc_head,
            max_seq_len=self.adacc_max_seq_len,
            offload=self.adacc_offload,
            offload_host_cap=self.adacc_offload_host_cap,
            auto_batch_size=self.adacc_auto_batch_size,
            expandable_segments=self.adacc_expandable_segments,
            allocator=self.adacc_allocator,
            profile_from=self.adacc_profile_from,
            codec_backends=list(self.adacc_codec_backends) if self.adacc_codec_backends else None,
            # --torch_compile: the Trainer compiles the model whole (Accelerate), adacc profiles
            # its blocks and head compiled with the same backend and plans without offload
            compile=(getattr(self, "torch_compile_backend", None) or "inductor")
            if getattr(self, "torch_compile", False)
            else None,
        )

    # The integration name is in `report_to` only while the object lives in this process: what
    # is logged, JSON-serialised or pickled (`training_args.bin`) shows the user's `report_to`.
    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if isinstance(d.get("report_to"), list):
            d["report_to"] = [r for r in d["report_to"] if r != INTEGRATION]
        return d

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if isinstance(state.get("report_to"), list):
            state["report_to"] = [r for r in state["report_to"] if r != INTEGRATION]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if getattr(self, "adacc", False):
            _enable_integration(self)


def _enable_integration(args: AdaccTrainingArguments) -> None:
    """Let a plain `Trainer` built with these arguments add `AdaccCallback` itself.

    A `Trainer` builds its callbacks from ``report_to`` names only, so adacc joins those names
    (registered when the first adacc-enabled arguments are created, never at import)."""
    from transformers.integrations import integration_utils

    integration_utils.INTEGRATION_TO_CALLBACK.setdefault(INTEGRATION, AdaccCallback)
    if INTEGRATION not in args.report_to:
        args.report_to = [*args.report_to, INTEGRATION]
