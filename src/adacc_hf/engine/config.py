"""`AdaccConfig`: what a session does (the options of `AdaccTrainingArguments` / `prepare`) and
what the run decides (optimizer, mixed precision, accumulation, sharding)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..codecs import CodecError, get_codec
from ..codecs.backends import BACKENDS
from ..errors import AdaccError
from ..runtime.offload import default_host_cap
from ..schema import HEADS
from ..solver import MAX_GRAD_ERROR, parse_budget

MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: The fields of `AdaccConfig` that are `solver.estimate_static_memory` options of the same name.
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


@dataclass
class AdaccConfig:
    """The options of an `AdaccSession`: the budget, the solver's limits and the run it plans for.

    `prepare` and `AdaccCallback` take any field as a keyword; `AdaccTrainingArguments` fills the
    options from its ``adacc_*`` fields and `run_config` the rest from the run (optimizer, mixed
    precision, accumulation, sharding). Every field is checked when the config is made.

    Attributes:
        budget: the step's device memory budget per device: bytes, ``"20GiB"`` (powers of 2),
            ``"20GB"`` (powers of 10), ``"80%"`` of device memory or ``"auto"`` (what is free
            plus what the model already holds, minus max(1 GiB, 5 %)); see `parse_budget`.
        codecs: the codecs the solver may pick, e.g. ``["int4_outlier", "int4_channel",
            "bitpack"]`` (None: each layer type's own; docs/options.md lists them).
        codec_backends: the codec implementations timed on each op, the fastest used
            (`codecs.backends`: ``"torch"``, ``"inductor"``, ``"triton"``, ``"bitsandbytes"``,
            ``"torchao"``); None: every one on CUDA, the default one elsewhere.
        zscore_threshold: the z-score above which a channel is an outlier that ``int4_outlier``
            keeps exact.
        adaptive: re-measure codec ratios and errors on tracking steps (1, 2, 4, ... steps
            apart) and switch policy when the optimum changes; False keeps the first policy.
        max_tracking_interval: the most optimizer steps between two tracking steps (>= 1).
        solver: the MILP solver: ``"cbc"`` (PuLP's) or ``"highs"`` (needs ``highspy``).
        solver_time_limit: seconds the MILP solver may search; then its best policy so far is
            used (full recomputation if it has none).
        max_codec_error: a codec whose measured relative error on an op exceeds this is not used
            for that op.
        max_grad_error: the bound on a block's gradient error (relative, input and parameter
            gradients), its lossy ops' measured errors added in quadrature (`profiler.fidelity`);
            None: no bound.
        split_blocks: let the blocks of a group run different policies (some without
            checkpointing) to fill the budget; False: one action table per group.
        head: a causal LM's head and loss: ``"full"`` (the default: logits returned as always),
            ``"chunked"`` (`runtime.head`: no logits in training forwards with labels) or
            ``"auto"`` (the solver's pick).
        optimizer: the optimizer whose states count in the static memory: a name of
            `solver.static.KNOWN_OPTIMIZERS`, as ``TrainingArguments.optim`` names it (`prepare`
            also takes the optimizer object).
        fp32_embeddings: 8-bit bitsandbytes optimizers keep ``nn.Embedding`` states in fp32: the
            HF Trainer registers that override (`run_config` sets it); a custom loop's optimizer
            has it only if it asks.
        mixed_precision: ``"bf16"`` / ``"fp16"``: forwards autocast to it (None or ``"no"``:
            no mixed precision).
        gradient_accumulation_steps: micro-batches per optimizer step (>= 1); gradients stay
            alive through every micro-batch but the first.
        max_seq_len: the longest sequence of the run, if known: its bucket is planned up front,
            so a budget too small for it fails at once (None: in the Trainer, read off the run
            where it says it; else each bucket is planned when its first batch comes).
        zero_stage: the DeepSpeed ZeRO stage (0-3) sharding the static memory over `world_size`
            ranks (`estimate_static_memory`).
        fsdp: FSDP full shard: parameters, gradients and optimizer states sharded over
            `world_size` ranks.
        world_size: the ranks the model is sharded or replicated over.
        offload_optimizer: optimizer states and master weights are kept off the device.
        master_weights: fp32 copies of 16-bit parameters (DeepSpeed mixed precision).
        ddp: replicated by DDP: its gradient buckets count (`solver.static`).
        zero_buckets: ZeRO-2: the gradient elements its reduce buckets hold through backward
            (``reduce_bucket_size``, twice with ``overlap_comm``; 0 without
            ``contiguous_gradients``); None: "auto" (hidden_size**2, counted twice).
        profile_repeats: timed runs per op when profiling (their median is kept).
        headroom: the fraction of the budget above static memory the solver leaves free, in
            [0, 0.5); None: 0.03 where the step model is not exact (CUDA's allocator, MoE
            routing), 0 where it is (`solver.headroom`).
        auto_batch_size: pick the micro-batch (and accumulation, keeping the global batch) with
            the best predicted tokens/s under the budget (`autobatch.choose_micro_batch`):
            `prepare` and every Trainer entry point.
        expandable_segments: CUDA: turn on the caching allocator's expandable segments where the
            user has not configured it (`runtime.allocator`): reserved memory then stays close
            to what is allocated.
        allocator: the caching allocator each plan's reserved peak is fitted to before its step
            runs (its step run dry on a host mirror of the model, `engine.reserved`): ``"auto"``
            (CUDA's, as configured; none elsewhere), ``"expandable"`` or ``"default"`` (modelled
            on any device), ``"off"`` (the guard alone re-plans after a step).
        profile_from: saved profiles to plan from where their fingerprint is this run's
            (`AdaccSession.reuse_profiles`): an ``adacc_profiles.json`` / ``adacc_profile.json``
            or a directory holding one. None: nothing in a custom loop, the output directory (or
            the checkpoint resumed from) in the Trainer; ``"none"``: never.
        offload: offload (ops and block inputs held in host memory until backward) as actions
            the solver weighs: None: on CUDA devices; True: also elsewhere (on CPU, a stand-in
            host outside torch's allocator: for tests and benchmarks); False: never.
        offload_host_cap: the host memory offload may hold: bytes, ``"16GiB"``, ``"50%"`` of the
            host's memory; None: half the host memory available when the first plan is made
            (`runtime.offload`).
        compile: the ``torch.compile`` backend the model's blocks will run under (True:
            ``"inductor"``): the profile measures them compiled too (`profiler.compiled`),
            compressed ops run through `runtime.saved_codecs`, and offload is not planned (no
            compiled form yet). None / False: eager.

    Raises:
        AdaccError: a field out of range or unknown (a codec, codec backend, head, ZeRO stage,
            mixed precision, host cap), a ``profile_from`` path that does not exist, or
            ``compile`` with ``offload=True``.
    """

    budget: int | str = "auto"
    codecs: list[str] | None = None
    codec_backends: list[str] | None = None
    zscore_threshold: float = 3.0
    adaptive: bool = True
    max_tracking_interval: int = 1024
    solver: str = "cbc"
    solver_time_limit: float = 10.0
    max_codec_error: float = 0.5
    max_grad_error: float | None = MAX_GRAD_ERROR
    split_blocks: bool = True
    head: str = "full"
    optimizer: str = "adamw_torch"
    fp32_embeddings: bool = False
    mixed_precision: str | None = None
    gradient_accumulation_steps: int = 1
    max_seq_len: int | None = None
    zero_stage: int = 0
    fsdp: bool = False
    world_size: int = 1
    offload_optimizer: bool = False
    master_weights: bool = False
    ddp: bool = False
    zero_buckets: int | None = None
    profile_repeats: int = 3
    headroom: float | None = None
    auto_batch_size: bool = False
    expandable_segments: bool = True
    allocator: str = "auto"
    profile_from: str | None = None
    offload: bool | None = None
    offload_host_cap: int | str | None = None
    compile: bool | str | None = None

    def __post_init__(self) -> None:
        self._check_compile()
        if self.profile_from not in (None, "none") and not os.path.exists(self.profile_from):
            raise AdaccError(
                f"profile_from: no such file or directory {self.profile_from!r} (an "
                "adacc_profiles.json or adacc_profile.json, or the output directory of an earlier "
                "run; 'none' to always profile)"
            )
        if self.offload_host_cap is not None:
            try:
                parse_budget(self.offload_host_cap, "cpu")
            except Exception as e:
                raise AdaccError(
                    f"offload_host_cap: {e} (bytes, '16GiB' or '50%' of the host's memory)"
                ) from None
        if self.headroom is not None and not 0 <= self.headroom < 0.5:
            raise AdaccError(f"headroom must be in [0, 0.5), got {self.headroom}")
        if self.codecs is not None:
            for name in self.codecs:
                try:
                    get_codec(name)
                except CodecError as e:
                    raise AdaccError(f"adacc codecs: {e}") from None
        if self.codec_backends is not None:
            unknown = sorted(set(self.codec_backends) - set(BACKENDS))
            if unknown or not self.codec_backends:
                raise AdaccError(
                    f"codec_backends: unknown {unknown or 'empty list'}; use some of "
                    f"{', '.join(BACKENDS)} (or None: all on CUDA)"
                )
        if self.allocator not in ("auto", "expandable", "default", "off"):
            raise AdaccError(
                f"allocator must be 'auto', 'expandable', 'default' or 'off', not {self.allocator!r}"
            )
        if self.head not in ("auto", *HEADS):
            raise AdaccError(f"head must be 'auto' or one of {list(HEADS)}, not {self.head!r}")
        if self.max_tracking_interval < 1:
            raise AdaccError("max_tracking_interval must be >= 1")
        if self.zero_stage not in (0, 1, 2, 3):
            raise AdaccError(f"zero_stage must be 0-3, got {self.zero_stage}")
        if self.mixed_precision not in (None, "no", *MIXED_PRECISION_DTYPES):
            raise AdaccError(
                f"mixed_precision must be 'bf16', 'fp16', 'no' or None, not {self.mixed_precision!r}"
            )
        if self.max_grad_error is not None and not self.max_grad_error >= 0:
            raise AdaccError(f"max_grad_error must be >= 0 or None, got {self.max_grad_error}")
        if self.gradient_accumulation_steps < 1:
            raise AdaccError("gradient_accumulation_steps must be >= 1")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise AdaccError(f"max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.zero_buckets is not None and (
            isinstance(self.zero_buckets, bool)
            or not isinstance(self.zero_buckets, int)
            or self.zero_buckets < 0
        ):
            raise AdaccError(
                "zero_buckets (ZeRO-2's reduce-bucket elements) must be an int >= 0 or None "
                f"(read from the DeepSpeed config), got {self.zero_buckets!r}"
            )

    def _check_compile(self) -> None:
        if self.compile is True:
            self.compile = "inductor"
        if not self.compile:
            self.compile = None
            return
        if not isinstance(self.compile, str):
            raise AdaccError(
                f"compile must be a torch.compile backend name, True or None, not {self.compile!r}"
            )
        if self.offload:
            raise AdaccError(
                f"compile={self.compile!r} with offload=True: offload has no compiled form yet; "
                "leave offload out (or False) or leave compile off"
            )
        self.offload = False

    def static_options(self) -> dict[str, Any]:
        """The `solver.estimate_static_memory` options of this run."""
        return {name: getattr(self, name) for name in STATIC_OPTIONS}

    def codec_params(self) -> dict[str, dict[str, Any]]:
        """The codecs' parameters by codec name (``zscore_threshold`` for ``int4_outlier``)."""
        return {"int4_outlier": {"zscore_threshold": self.zscore_threshold}}

    def offloads_on(self, device: torch.device) -> bool:
        """Whether plans on `device` may offload (see ``offload``)."""
        return device.type == "cuda" if self.offload is None else bool(self.offload)

    def host_cap_nbytes(self) -> int:
        """Bytes of host memory offload may hold (``offload_host_cap``)."""
        if self.offload_host_cap is None:
            return default_host_cap()
        return parse_budget(self.offload_host_cap, "cpu")

    @property
    def autocast(self) -> torch.dtype | None:
        """The dtype forwards autocast to (None: no mixed precision configured)."""
        return MIXED_PRECISION_DTYPES.get(self.mixed_precision or "")


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
