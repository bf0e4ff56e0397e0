"""Layer types, actions, ops, per-op action tables and traces: the vocabulary of a policy (no
torch import)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import PolicyError

POLICY_FORMAT = 1
PROFILE_FORMAT = 2

# ------------------------------------------------------------------------------ layer types
LAYER_TYPES: dict[str, str] = {
    "norm": "LayerNorm / RMSNorm and its statistics",
    "qkv": "query / key / value projections and rotary embedding",
    "attn_scores": "attention scores (q @ k^T, scaled, masked, biased)",
    "attn_probs": "attention probabilities (softmax output)",
    "attn_dropout": "dropout on attention probabilities",
    "attn_context": "attention context (probs @ v)",
    "attn_fused": "fused attention kernel (SDPA flash / efficient)",
    "attn_out": "attention output projection and head merge",
    "mlp_up": "MLP up / gate projection",
    "act": "MLP activation function",
    "mlp_down": "MLP down projection",
    "dropout": "dropout (hidden states)",
    "elementwise": "residual adds, gating and other glue",
    "router": "mixture-of-experts router: gate logits, routing probabilities, top-k choice",
}

#: The attention core: what Megatron-style selective recompute recomputes.
ATTENTION_CORE = frozenset(
    {"attn_scores", "attn_probs", "attn_dropout", "attn_context", "attn_fused"}
)

#: Default codec per layer type (the paper's layer-specific codecs, except Q / K / V: on the
#: pretrained SmolLM2-135M, INT4 per channel (the paper's) moved the whole model's gradients by
#: 0.17-0.25 for Q or K alone and 0.37 for all three, FP8 by 0.03-0.045 and 0.06; keeping the
#: attention-sink rows exact beside the INT4 payload did not help (0.19); `EXTRA_CODECS`).
CODEC_FOR_LAYER: dict[str, str] = {
    "norm": "int4_outlier",
    "qkv": "fp8_e4m3",
    "attn_scores": "int4_asym",
    "attn_probs": "int4_asym",
    "attn_dropout": "int4_asym",
    "attn_context": "int4_channel",
    "attn_fused": "int4_channel",
    "attn_out": "int4_outlier",
    "mlp_up": "int4_outlier",
    "act": "int4_outlier",
    "mlp_down": "int4_outlier",
    "dropout": "int4_outlier",
    "elementwise": "int4_outlier",
}

#: Codecs profiled beside the default one, for the solver to weigh under the gradient-error bound.
EXTRA_CODECS: dict[str, tuple[str, ...]] = {"qkv": ("int4_channel",)}

#: Layer types whose cacheable outputs every policy retains (never recomputes nor compresses): an
#: MoE router recomputed in backward from inputs a codec altered can pick other experts than it did
#: in forward, and the gradients then belong to another computation. Router outputs are small
#: (tokens x experts), and the top-k choice recomputed from retained probabilities is exact.
ALWAYS_RETAIN = frozenset({"router"})
#: How a causal LM's head and loss run: the model's own ``[tokens x vocab]`` logits, or chunked
#: (the logits never materialised: `runtime.head`).
HEADS = ("full", "chunked")

FLOAT_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16")
#: Outputs smaller than this (per-row statistics, scalars) are never compressed.
MIN_COMPRESS_CHANNELS = 8
MIN_COMPRESS_NUMEL = 256


# ------------------------------------------------------------------------------------ actions
ActionKind = Literal["retain", "recompute", "compress", "offload"]
ACTION_KINDS: tuple[str, ...] = ("retain", "recompute", "compress", "offload")


@dataclass(frozen=True)
class Action:
    """What happens to one op's output between forward and backward.

    ``retain``, ``recompute``, ``compress`` with a codec, or ``offload`` (to host memory until
    backward) as it is or encoded with a codec first (``offload:<codec>``). Build one with
    ``Action.retain()``, ``Action.recompute()``, ``Action.compress(codec, **params)`` or
    ``Action.offload(codec=None, **params)``.

    Attributes:
        kind: ``"retain"``, ``"recompute"``, ``"compress"`` or ``"offload"``.
        codec: the codec (needed by ``compress``, optional for ``offload``, none otherwise).
        params: the codec's parameters, as sorted ``(name, value)`` pairs.
        backend: the codec's implementation the profiler found fastest on the device
            (``codecs.backends``; None: the kernel mode's choice).

    Raises:
        PolicyError: an unknown kind, ``compress`` without a codec, a codec on ``retain`` /
            ``recompute``, or a backend without a codec.
    """

    kind: ActionKind
    codec: str | None = None
    params: tuple[tuple[str, Any], ...] = ()
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise PolicyError(f"unknown action {self.kind!r}; use one of {', '.join(ACTION_KINDS)}")
        if self.kind == "compress" and self.codec is None:
            raise PolicyError("a 'compress' action needs a codec")
        if self.kind in ("retain", "recompute") and self.codec is not None:
            raise PolicyError(f"a {self.kind!r} action takes no codec; use 'compress' or 'offload'")
        if self.backend is not None and self.codec is None:
            raise PolicyError(f"a {self.kind!r} action without a codec takes no backend")

    @property
    def keeps(self) -> bool:
        """The output is kept for backward (not recomputed)."""
        return self.kind != "recompute"

    @property
    def offloaded(self) -> bool:
        return self.kind == "offload"

    @classmethod
    def retain(cls) -> Action:
        """Keep the output as it is."""
        return cls("retain")

    @classmethod
    def recompute(cls) -> Action:
        """Drop the output; recompute it in backward."""
        return cls("recompute")

    @classmethod
    def compress(cls, codec: str, backend: str | None = None, **params: Any) -> Action:
        """Keep the output encoded with `codec`.

        Args:
            codec: the codec's name (e.g. ``"int4_outlier"``).
            backend: the codec's implementation (None: the kernel mode's choice).
            **params: the codec's parameters (e.g. ``zscore_threshold=3.0``).
        """
        return cls("compress", codec, tuple(sorted(params.items())), backend)

    @classmethod
    def offload(cls, codec: str | None = None, backend: str | None = None, **params: Any) -> Action:
        """Hold the output in host memory until backward, as it is or encoded with `codec`.

        Args:
            codec: the codec to encode it with first (None: as it is).
            backend: the codec's implementation (None: the kernel mode's choice).
            **params: the codec's parameters.
        """
        return cls("offload", codec, tuple(sorted(params.items())), backend)

    @property
    def codec_kwargs(self) -> dict[str, Any]:
        """``get_codec(action.codec, **action.codec_kwargs)`` builds the codec this action runs."""
        return {**dict(self.params), "backend": self.backend}

    def to_json(self) -> str | dict[str, Any]:
        if self.codec is None:
            return self.kind
        d: dict[str, Any] = {self.kind: self.codec, "params": dict(self.params)}
        if self.backend is not None:
            d["backend"] = self.backend
        return d

    @classmethod
    def from_json(cls, obj: Any) -> Action:
        if isinstance(obj, str):
            if obj == "compress":
                raise PolicyError("a 'compress' action must name its codec: {'compress': NAME}")
            return cls(obj)  # type: ignore[arg-type]
        if isinstance(obj, dict):
            kind = next((k for k in ("compress", "offload") if isinstance(obj.get(k), str)), None)
            if kind is not None:
                params = obj.get("params", {})
                if not isinstance(params, dict):
                    raise PolicyError(f"codec params must be an object, got {params!r}")
                backend = obj.get("backend")
                if backend is not None and not isinstance(backend, str):
                    raise PolicyError(f"a codec backend must be a name, got {backend!r}")
                return cls(kind, obj[kind], tuple(sorted(params.items())), backend)  # type: ignore[arg-type]
        raise PolicyError(
            f"cannot read action {obj!r}: expected 'retain', 'recompute', 'offload', "
            "{'compress': CODEC, 'params': {...}, 'backend': NAME} or "
            "{'offload': CODEC, 'params': {...}}"
        )

    def __str__(self) -> str:
        if self.codec is None:
            return self.kind
        extra = ",".join(f"{k}={v}" for k, v in self.params)
        on = f"@{self.backend}" if self.backend else ""
        return f"{self.kind}:{self.codec}" + (f"({extra})" if extra else "") + on


RECOMPUTE = Action("recompute")
RETAIN = Action("retain")


# ---------------------------------------------------------------------------------------- ops
@dataclass(frozen=True)
class OpSpec:
    """One op of a block, as traced: its key, what it is, and what its output is.

    ``aten``, ``dtype`` and ``shape_class`` form the op's signature: the runtime checks it
    before acting on an op, so a policy never acts on another op that took this one's key (a
    block traced with one op more or fewer, a different attention path).

    Attributes:
        key: the op's key within its block (what policy tables address).
        layer_type: what the op is (`LAYER_TYPES`).
        shape: the first tensor output's shape (the one a codec compresses).
        dtype: the first tensor output's dtype.
        nbytes: the bytes of every tensor output.
        saved: autograd keeps this output for backward when nothing is checkpointed.
        cacheable: False for outputs that are mutated in place after being read (they can only
            be recomputed).
        aten: the op overload, e.g. ``"aten.mm.default"`` (``""`` in policies written before
            signatures existed).
        shape_class: the rank of each tensor output, e.g. ``"4,3"`` (``""`` in older policies).
        mask: the op makes a random keep-mask (``native_dropout``'s bool mask, or a tensor an
            RNG op fills in place, as CPU dropout does) that ``bitpack`` stores at 1 bit per
            element; the runtime replays the RNG.
        side_nbytes: what compressing the op keeps besides its codec's payload (its other
            outputs: layer norm's mean and rstd, attention's log-sum-exp; 0 for a mask).
        rng_states: generator states a kept output holds for replay: 1 for an op that draws from
            an RNG, one per in-place fill of a mask an RNG fills (CPU dropout: ``bernoulli_``,
            then ``div_``).
        feeds_backward: backward reads its output, or what is made from it (a compiled graph
            neither saves nor recomputes an op that feeds no backward: `profiler.compiled`);
            True where not traced so.
    """

    key: str
    layer_type: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    saved: bool  # autograd keeps this output for backward when nothing is checkpointed
    cacheable: bool  # False for outputs that are mutated in place after being read
    aten: str = ""  # the op overload ("" in policies written before signatures existed)
    shape_class: str = ""  # ranks of the tensor outputs ("" in older policies)
    mask: bool = False  # a random keep-mask (see above)
    # what compressing the op keeps besides its codec's payload: its other outputs (see above)
    side_nbytes: int = 0
    # generator states a kept output holds for replay: 1 for an op that draws from an RNG, one per
    # in-place fill of a mask an RNG fills (CPU dropout: bernoulli_, then div_)
    rng_states: int = 0
    # backward reads its output, or what is made from it (a compiled graph neither saves nor
    # recomputes an op that feeds no backward: `profiler.compiled`); True where not traced so
    feeds_backward: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @property
    def signature(self) -> tuple[str, str, str]:
        return (self.aten, self.dtype, self.shape_class)

    def to_json(self) -> dict[str, Any]:
        d = {
            "key": self.key,
            "layer_type": self.layer_type,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "nbytes": self.nbytes,
            "saved": self.saved,
            "cacheable": self.cacheable,
        }
        if self.aten:
            d["aten"] = self.aten
        if self.shape_class:
            d["shape_class"] = self.shape_class
        if self.mask:
            d["mask"] = True
        if self.side_nbytes:
            d["side_nbytes"] = self.side_nbytes
        if self.rng_states:
            d["rng_states"] = self.rng_states
        if not self.feeds_backward:
            d["feeds_backward"] = False
        return d

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> OpSpec:
        return cls(
            key=str(obj["key"]),
            layer_type=str(obj["layer_type"]),
            shape=tuple(int(s) for s in obj["shape"]),
            dtype=str(obj["dtype"]),
            nbytes=int(obj["nbytes"]),
            saved=bool(obj["saved"]),
            cacheable=bool(obj["cacheable"]),
            aten=str(obj.get("aten", "")),
            shape_class=str(obj.get("shape_class", "")),
            mask=bool(obj.get("mask", False)),
            side_nbytes=int(obj.get("side_nbytes", 0)),
            rng_states=int(obj.get("rng_states", 0)),
            feeds_backward=bool(obj.get("feeds_backward", True)),
        )


def codec_candidates(op: OpSpec, allowed: Iterable[str] | None = None) -> list[str]:
    """Names of the codecs that may compress ``op``'s output: none for small outputs (statistics,
    scalars) and non-float dtypes, ``bitpack`` for bool and random masks, else the layer type's
    own codec (first) and its `EXTRA_CODECS`, or every ``allowed`` codec (none for `ALWAYS_RETAIN` layer types). The one rule the
    profiler and the policy builders share."""
    if op.layer_type in ALWAYS_RETAIN:
        return []
    if op.dtype == "torch.bool" or op.mask:
        return ["bitpack"]
    if op.dtype not in FLOAT_DTYPES:
        return []
    if not op.shape or op.shape[-1] < MIN_COMPRESS_CHANNELS or op.numel < MIN_COMPRESS_NUMEL:
        return []
    if allowed is None:
        default = CODEC_FOR_LAYER.get(op.layer_type, "int4_outlier")
        return [default, *EXTRA_CODECS.get(op.layer_type, ())]
    return [n for n in allowed if n != "bitpack"]


# ----------------------------------------------------------------------------------- policies
@dataclass
class Variant:
    """`count` consecutive blocks of a group that share one action table."""

    count: int
    checkpoint: bool
    actions: dict[str, Action] = field(default_factory=dict)
    # a checkpointed block's input (what its recompute starts from) held in host memory, not on
    # the device, from its forward to its backward (`runtime.offload`)
    offload_input: bool = False

    def action(self, key: str) -> Action:
        return self.actions.get(key, RECOMPUTE)

    @property
    def offloads(self) -> bool:
        """Whether the block moves anything to host memory."""
        return self.checkpoint and (
            self.offload_input or any(a.offloaded for a in self.actions.values())
        )

    def fingerprint(self) -> str:
        """A short hash of the action table (not the count): variants acting alike share it."""
        table: list[Any] = [
            self.checkpoint,
            {k: a.to_json() for k, a in sorted(self.actions.items())},
        ]
        if self.offload_input:
            table.append("offload_input")
        body = json.dumps(table, sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:12]

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "count": self.count,
            "checkpoint": self.checkpoint,
            "actions": {k: a.to_json() for k, a in sorted(self.actions.items())},
        }
        if self.offload_input:
            d["offload_input"] = True
        return d

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Variant:
        return cls(
            count=int(obj["count"]),
            checkpoint=bool(obj["checkpoint"]),
            actions={str(k): Action.from_json(v) for k, v in obj.get("actions", {}).items()},
            offload_input=bool(obj.get("offload_input", False)),
        )


def variant_key(group: str, variant: Variant) -> str:
    """How a group's action table is named in ``Profile.variant_transients``."""
    return f"{group}:{variant.fingerprint()}"


@dataclass
class GroupPolicy:
    """The op list of one block group and the variants its blocks run."""

    ops: list[OpSpec]
    variants: list[Variant]
    input_nbytes: int = 0  # bytes of one block's input (held by a checkpoint)

    @property
    def num_blocks(self) -> int:
        return sum(v.count for v in self.variants)

    def block_variants(self) -> Iterator[Variant]:
        """The variant of each block of the group, in order."""
        for v in self.variants:
            for _ in range(v.count):
                yield v

    def op(self, key: str) -> OpSpec | None:
        return next((o for o in self.ops if o.key == key), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "input_nbytes": self.input_nbytes,
            "ops": [o.to_json() for o in self.ops],
            "variants": [v.to_json() for v in self.variants],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> GroupPolicy:
        return cls(
            ops=[OpSpec.from_json(o) for o in obj["ops"]],
            variants=[Variant.from_json(v) for v in obj["variants"]],
            input_nbytes=int(obj.get("input_nbytes", 0)),
        )


# ------------------------------------------------------------------------------------- traces
@dataclass
class BlockTrace:
    """One traced block: the ordered op list a group's action tables address."""

    group: str
    path: str  # the block that was traced
    num_blocks: int
    input_nbytes: int
    ops: list[OpSpec] = field(default_factory=list)


@dataclass
class ModelTrace:
    model_type: str
    adapter: str
    adapter_version: int
    groups: dict[str, BlockTrace]
