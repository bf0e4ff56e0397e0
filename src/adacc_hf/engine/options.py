"""Adacc's options as typed groups, each checked when it is made.

`AdaccConfig` holds one of each (``config.memory``, ``config.compression``, ``config.offloading``,
``config.compilation``, ``config.solving``, ``config.tracking``) beside the budget and the facts
of the run (`facts.RunFacts`). Every option has one name everywhere: the field of its group, the
keyword of `prepare`, `AdaccCallback` and `AdaccConfig`, and ``--adacc_<name>`` of
`AdaccTrainingArguments` (whose ``--help`` text is the group's entry for it, `option_help`).
`FlatOptions` types those keywords.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import TypedDict

from ..codecs import CodecError, get_codec
from ..codecs.backends import BACKENDS
from ..errors import AdaccError
from ..runtime.offload import default_host_cap
from ..schema import HEADS
from ..solver import MAX_GRAD_ERROR, parse_budget

__all__ = [
    "GROUPS",
    "OPTION_GROUP",
    "AdaccOptions",
    "CodecOptions",
    "CompileOptions",
    "FlatOptions",
    "MemoryOptions",
    "OffloadOptions",
    "SessionOptions",
    "SolverOptions",
    "TrackingOptions",
    "option_help",
]

ALLOCATORS = ("auto", "expandable", "default", "off")


@dataclass(frozen=True)
class MemoryOptions:
    """How the budget is filled: the room kept free, CUDA's allocator, the batches planned for.

    Attributes:
        headroom (float | None, default None): the fraction of the budget above static memory
            the solver leaves free, in [0, 0.5); None: 0.03 where the step model is not exact
            (CUDA's caching allocator, MoE routing), 0 where it is (`solver.headroom`).
        allocator (str, default ``"auto"``): the caching allocator each plan's reserved peak is
            fitted to before its step runs (its step run dry on a host mirror of the model,
            `engine.reserved`): ``"auto"`` (CUDA's, as configured; none elsewhere),
            ``"expandable"`` or ``"default"`` (modelled on any device), ``"off"`` (the guard
            alone re-plans after a step).
        expandable_segments (bool, default True): on CUDA, turn on the caching allocator's
            expandable segments unless ``PYTORCH_CUDA_ALLOC_CONF`` is set (`runtime.allocator`):
            without them a step reserves well above what it allocates (1.4 GiB over a 6 GiB step
            measured on an H100), and CUDA runs out when reserved memory does.
        max_seq_len (int | None, default None): the longest sequence of the run (>= 1): its
            bucket is planned before the first step, so a budget too small for it fails at once.
            None: the Trainer reads it off TRL's ``max_length``, a collator padding to a fixed
            length or the dataset where they say it; else each bucket is planned when its first
            batch comes.
        auto_batch_size (bool, default False): pick the micro-batch with the best predicted
            tokens/s whose step fits the budget, keeping the global batch by adjusting gradient
            accumulation (`engine.autobatch`): the Trainer plans it before it builds its data
            loader (global batch: ``per_device_train_batch_size`` x
            ``gradient_accumulation_steps``); `prepare` needs a ``sample_batch``.

    Raises:
        AdaccError: a headroom outside [0, 0.5), an unknown allocator, ``max_seq_len`` < 1.

    Example:
        >>> MemoryOptions(max_seq_len=2048, auto_batch_size=True).allocator
        'auto'
    """

    headroom: float | None = None
    allocator: str = "auto"
    expandable_segments: bool = True
    max_seq_len: int | None = None
    auto_batch_size: bool = False

    def __post_init__(self) -> None:
        if self.headroom is not None and not 0 <= self.headroom < 0.5:
            raise AdaccError(f"headroom must be in [0, 0.5), got {self.headroom}")
        if self.allocator not in ALLOCATORS:
            raise AdaccError(
                f"allocator must be 'auto', 'expandable', 'default' or 'off', not {self.allocator!r}"
            )
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise AdaccError(f"max_seq_len must be >= 1, got {self.max_seq_len}")


@dataclass(frozen=True)
class CodecOptions:
    """Which codecs may compress activations, and the errors they may cause.

    Attributes:
        codecs (list[str] | None, default None): the codecs the solver may pick, e.g.
            ``["int4_outlier", "int4_channel", "bitpack"]`` (docs/options.md lists them; the
            ``--adacc_codecs`` flag also takes one comma-separated string); None: each layer
            type's own.
        codec_backends (list[str] | None, default None): the codec implementations timed on
            each op, the fastest used (`codecs.backends`): ``"torch"`` (the reference),
            ``"inductor"``, ``"triton"``, ``"bitsandbytes"``, ``"torchao"``; None: every one on
            CUDA, the reference elsewhere.
        zscore_threshold (float, default 3.0): the z-score above which a channel is an outlier
            that ``int4_outlier`` keeps exact.
        max_codec_error (float, default 0.5): a codec whose measured relative error on an op
            exceeds this is not used for that op.
        max_grad_error (float | None, default 0.1): the bound on a block's relative gradient
            error (input and parameter gradients), its lossy ops' measured errors added in
            quadrature (`profiler.fidelity`); 0: no lossy codec; None (on the command line: a
            negative value): no bound.

    Raises:
        AdaccError: an unknown codec or codec backend, an empty backend list, a negative
            ``max_grad_error``.

    Example:
        >>> CodecOptions(codecs=["int4_outlier", "bitpack"], max_grad_error=0.05).codec_params()
        {'int4_outlier': {'zscore_threshold': 3.0}}
    """

    codecs: list[str] | None = None
    codec_backends: list[str] | None = None
    zscore_threshold: float = 3.0
    max_codec_error: float = 0.5
    max_grad_error: float | None = MAX_GRAD_ERROR

    def __post_init__(self) -> None:
        for name in self.codecs or ():
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
        if self.max_grad_error is not None and not self.max_grad_error >= 0:
            raise AdaccError(f"max_grad_error must be >= 0 or None, got {self.max_grad_error}")

    def codec_params(self) -> dict[str, dict[str, Any]]:
        """The codecs' parameters by codec name (``zscore_threshold`` for ``int4_outlier``).

        Returns:
            Keyword arguments by codec name, as `profiler.profile_model` takes them.
        """
        return {"int4_outlier": {"zscore_threshold": self.zscore_threshold}}


@dataclass(frozen=True)
class OffloadOptions:
    """Whether activations may wait for backward in host memory, and how much of it.

    Attributes:
        offload (bool | None, default None): let the solver hold op outputs (as they are or
            encoded first) and block inputs in host memory until backward, copied on a side
            stream and brought back one block ahead: None: on CUDA devices; True: also elsewhere
            (on CPU a stand-in host outside torch's allocator, for tests and benchmarks); False:
            never. Not with ``compile`` (offload has no compiled form yet).
        offload_host_cap (int | str | None, default None): the host memory offload may hold:
            bytes, ``"16GiB"`` or ``"50%"`` of the host's memory; None: half the host memory
            available when the first plan is made (`runtime.offload`).

    Raises:
        AdaccError: a host cap `parse_budget` cannot read.

    Example:
        >>> OffloadOptions(offload_host_cap="16GiB").host_cap_nbytes()
        17179869184
    """

    offload: bool | None = None
    offload_host_cap: int | str | None = None

    def __post_init__(self) -> None:
        if self.offload_host_cap is not None:
            try:
                parse_budget(self.offload_host_cap, "cpu")
            except Exception as e:
                raise AdaccError(
                    f"offload_host_cap: {e} (bytes, '16GiB' or '50%' of the host's memory)"
                ) from None

    def offloads_on(self, device: torch.device) -> bool:
        """Whether plans on `device` may offload (see ``offload``).

        Args:
            device: the device the model trains on.

        Returns:
            ``offload`` where it is given, else whether `device` is a CUDA device.
        """
        return device.type == "cuda" if self.offload is None else bool(self.offload)

    def host_cap_nbytes(self) -> int:
        """Bytes of host memory offload may hold (``offload_host_cap``).

        Returns:
            The cap in bytes (its default read off the host now).
        """
        if self.offload_host_cap is None:
            return default_host_cap()
        return parse_budget(self.offload_host_cap, "cpu")


@dataclass(frozen=True)
class CompileOptions:
    """Whether the model's blocks run under ``torch.compile``.

    Attributes:
        compile (bool | str | None, default None): the ``torch.compile`` backend the model's
            blocks will run under (True: ``"inductor"``): the profile measures them compiled too
            (`profiler.compiled`), compressed ops run through `runtime.saved_codecs`, and
            offload is not planned (no compiled form yet). None / False: eager (stored as None).
            The Trainer sets it from ``--torch_compile`` (and ``--torch_compile_backend``).

    Raises:
        AdaccError: anything but a backend name, True, False or None.

    Example:
        >>> CompileOptions(compile=True).compile
        'inductor'
    """

    compile: bool | str | None = None

    def __post_init__(self) -> None:
        value = "inductor" if self.compile is True else (self.compile or None)
        if value is not None and not isinstance(value, str):
            raise AdaccError(
                f"compile must be a torch.compile backend name, True or None, not {value!r}"
            )
        object.__setattr__(self, "compile", value)


@dataclass(frozen=True)
class SolverOptions:
    """How each bucket's policy is solved: the MILP solver, its limits, the LM head.

    Attributes:
        solver (str, default ``"cbc"``): the MILP solver: ``"cbc"`` (PuLP's) or ``"highs"``
            (needs ``highspy``).
        solver_time_limit (float, default 10.0): seconds the MILP solver may search; then its
            best policy so far is used (with a warning); with none, or where the solver fails,
            full recomputation.
        split_blocks (bool, default True): let the blocks of a group run different policies
            (some without checkpointing) to fill the budget; False: one action table per group.
        head (str, default ``"full"``): a causal LM's head and loss: ``"full"`` (the model's
            own logits), ``"chunked"`` (`runtime.head`: the loss chunk by chunk; the [tokens x
            vocab] logits never exist and training forwards with labels return
            ``logits=None``) or ``"auto"`` (the solver picks the fastest that fits).
        profile_repeats (int, default 3): timed runs per op when profiling (their median is
            kept).

    Raises:
        AdaccError: an unknown head.

    Example:
        >>> SolverOptions(solver="highs", head="auto").solver_time_limit
        10.0
    """

    solver: str = "cbc"
    solver_time_limit: float = 10.0
    split_blocks: bool = True
    head: str = "full"
    profile_repeats: int = 3

    def __post_init__(self) -> None:
        if self.head not in ("auto", *HEADS):
            raise AdaccError(f"head must be 'auto' or one of {list(HEADS)}, not {self.head!r}")


@dataclass(frozen=True)
class TrackingOptions:
    """What the run learns as it goes: the rectifier's tracking steps, saved profiles.

    Attributes:
        adaptive (bool, default True): re-measure codec ratios and errors on tracking steps (1,
            2, 4, ... optimizer steps apart) and switch policy when the optimum changes (in a
            custom loop: call ``session.step_done(step)`` after each optimizer step); False keeps
            the first policy.
        max_tracking_interval (int, default 1024): the most optimizer steps between two
            tracking steps (>= 1).
        profile_from (str | None, default None): saved profiles to plan from where their
            fingerprint is this run's (model, dtype, device, versions, bucket;
            `AdaccSession.reuse_profiles`): an ``adacc_profiles.json`` / ``adacc_profile.json``
            or a directory holding one. None: nothing in a custom loop, the output directory's
            (or the resumed checkpoint's) in the Trainer; ``"none"``: always profile.

    Raises:
        AdaccError: ``max_tracking_interval`` < 1, a ``profile_from`` path that does not exist.

    Example:
        >>> TrackingOptions(adaptive=False, profile_from="none").max_tracking_interval
        1024
    """

    adaptive: bool = True
    max_tracking_interval: int = 1024
    profile_from: str | None = None

    def __post_init__(self) -> None:
        if self.max_tracking_interval < 1:
            raise AdaccError("max_tracking_interval must be >= 1")
        if self.profile_from not in (None, "none") and not os.path.exists(self.profile_from):
            raise AdaccError(
                f"profile_from: no such file or directory {self.profile_from!r} (an "
                "adacc_profiles.json or adacc_profile.json, or the output directory of an earlier "
                "run; 'none' to always profile)"
            )


#: The option groups of `AdaccConfig`, by its attribute holding each.
GROUPS: dict[str, type] = {
    "memory": MemoryOptions,
    "compression": CodecOptions,
    "offloading": OffloadOptions,
    "compilation": CompileOptions,
    "solving": SolverOptions,
    "tracking": TrackingOptions,
}
#: Each option's group attribute, by the option's name.
OPTION_GROUP: dict[str, str] = {
    f.name: attr for attr, cls in GROUPS.items() for f in dataclasses.fields(cls)
}

_ENTRY = re.compile(r"^(\w+) \([^)]*\): ")


def option_help(name: str) -> str:
    """An option's text in its group's docstring, as one line of plain text (``--help``).

    Args:
        name: the option's name (a field of one of the `GROUPS`).

    Returns:
        Its ``Attributes:`` entry without the name, type and default, and without markup.
    """
    doc = inspect.getdoc(GROUPS[OPTION_GROUP[name]]) or ""
    body = doc.split("Attributes:\n", 1)[1].split("\n\n", 1)[0]
    entries: dict[str, list[str]] = {}
    for line in inspect.cleandoc(body).splitlines():
        m = _ENTRY.match(line)
        if m:
            entries[m.group(1)] = [line[m.end() :]]
        elif entries:
            entries[next(reversed(entries))].append(line.strip())
    text = " ".join(entries[name])
    return re.sub(r"`+([^`]*)`+", r"\1", text)


class SessionOptions(TypedDict, total=False):
    """The options `prepare` takes as keywords beside those it names itself (``budget``,
    ``codecs``, ``adaptive``, ``auto_batch_size``): each the group field of its name."""

    headroom: float | None
    allocator: str
    expandable_segments: bool
    max_seq_len: int | None
    codec_backends: list[str] | None
    zscore_threshold: float
    max_codec_error: float
    max_grad_error: float | None
    offload: bool | None
    offload_host_cap: int | str | None
    compile: bool | str | None
    solver: str
    solver_time_limit: float
    split_blocks: bool
    head: str
    profile_repeats: int
    max_tracking_interval: int
    profile_from: str | None


class FlatOptions(SessionOptions, total=False):
    """Every option of every group by its name (`AdaccConfig`'s keywords beside ``budget``)."""

    codecs: list[str] | None
    adaptive: bool
    auto_batch_size: bool


class AdaccOptions(FlatOptions, total=False):
    """``budget`` and every option by its name (`AdaccCallback`'s keywords)."""

    budget: int | str
