"""The vocabulary every part of adacc-hf shares, as plain data (no torch import).

* Layer types (`LAYER_TYPES`), the attention core and each layer type's default codec.
* `Action` (retain / compress with a codec / recompute), `OpSpec` (one traced op of a block) and
  `Variant` / `GroupPolicy` (the per-op action tables a `Policy` is made of).
* `BlockTrace` / `ModelTrace`: what tracing a model yields.
* `CodecProfile` / `OpProfile` / `GroupProfile` / `Profile`: what the profiler measures and the
  solver reads.
* Format versions of the JSON artifacts.

Op keys look like ``"self_attn.q_proj/mm#0"``: the submodule the op runs in (relative to the block;
``""`` for the block's own code), the aten op, and its occurrence index there.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from .errors import PolicyError

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

#: Default codec per layer type (the paper's layer-specific codecs).
CODEC_FOR_LAYER: dict[str, str] = {
    "norm": "int4_outlier",
    "qkv": "int4_channel",
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

#: Layer types whose cacheable outputs every policy retains (never recomputes nor compresses): an
#: MoE router recomputed in backward from inputs a codec altered can pick other experts than it did
#: in forward, and the gradients then belong to another computation. Router outputs are small
#: (tokens x experts), and the top-k choice recomputed from retained probabilities is exact.
ALWAYS_RETAIN = frozenset({"router"})

FLOAT_DTYPES = ("torch.float32", "torch.float16", "torch.bfloat16")
#: Outputs smaller than this (per-row statistics, scalars) are never compressed.
MIN_COMPRESS_CHANNELS = 8
MIN_COMPRESS_NUMEL = 256


# ------------------------------------------------------------------------------------ actions
ActionKind = Literal["retain", "recompute", "compress"]
ACTION_KINDS: tuple[str, ...] = ("retain", "recompute", "compress")


@dataclass(frozen=True)
class Action:
    """What happens to one op's output: ``retain``, ``recompute`` or ``compress`` with a codec."""

    kind: ActionKind
    codec: str | None = None
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ACTION_KINDS:
            raise PolicyError(f"unknown action {self.kind!r}; use one of {', '.join(ACTION_KINDS)}")
        if (self.kind == "compress") != (self.codec is not None):
            raise PolicyError("a 'compress' action needs a codec, and only 'compress' takes one")

    @classmethod
    def retain(cls) -> Action:
        return cls("retain")

    @classmethod
    def recompute(cls) -> Action:
        return cls("recompute")

    @classmethod
    def compress(cls, codec: str, **params: Any) -> Action:
        return cls("compress", codec, tuple(sorted(params.items())))

    def to_json(self) -> str | dict[str, Any]:
        if self.kind != "compress":
            return self.kind
        return {"compress": self.codec, "params": dict(self.params)}

    @classmethod
    def from_json(cls, obj: Any) -> Action:
        if isinstance(obj, str):
            if obj == "compress":
                raise PolicyError("a 'compress' action must name its codec: {'compress': NAME}")
            return cls(obj)  # type: ignore[arg-type]
        if isinstance(obj, dict) and isinstance(obj.get("compress"), str):
            params = obj.get("params", {})
            if not isinstance(params, dict):
                raise PolicyError(f"codec params must be an object, got {params!r}")
            return cls.compress(obj["compress"], **params)
        raise PolicyError(
            f"cannot read action {obj!r}: expected 'retain', 'recompute' or "
            "{'compress': CODEC, 'params': {...}}"
        )

    def __str__(self) -> str:
        if self.kind != "compress":
            return self.kind
        extra = ",".join(f"{k}={v}" for k, v in self.params)
        return f"compress:{self.codec}" + (f"({extra})" if extra else "")


RECOMPUTE = Action("recompute")
RETAIN = Action("retain")


# ---------------------------------------------------------------------------------------- ops
@dataclass(frozen=True)
class OpSpec:
    """One op of a block, as traced: its key, what it is, and what its output is.

    ``aten`` (the op overload, e.g. ``"aten.mm.default"``), ``dtype`` and ``shape_class`` (the
    rank of each tensor output, e.g. ``"4,3"``) form the op's signature: the runtime checks it
    before acting on an op, so a policy never acts on another op that took this one's key (a
    block traced with one op more or fewer, a different attention path). ``mask``: the op makes
    a random keep-mask (``native_dropout``'s bool mask, or a tensor an RNG op fills in place, as
    CPU dropout does) that ``bitpack`` stores at 1 bit per element; the runtime replays the RNG.
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
        )


def codec_candidates(op: OpSpec, allowed: Iterable[str] | None = None) -> list[str]:
    """Names of the codecs that may compress ``op``'s output: none for small outputs (statistics,
    scalars) and non-float dtypes, ``bitpack`` for bool and random masks, else the layer type's
    own codec or every ``allowed`` codec (none for `ALWAYS_RETAIN` layer types). The one rule the
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
        return [CODEC_FOR_LAYER.get(op.layer_type, "int4_outlier")]
    return [n for n in allowed if n != "bitpack"]


# ----------------------------------------------------------------------------------- policies
@dataclass
class Variant:
    """`count` consecutive blocks of a group that share one action table."""

    count: int
    checkpoint: bool
    actions: dict[str, Action] = field(default_factory=dict)

    def action(self, key: str) -> Action:
        return self.actions.get(key, RECOMPUTE)

    def fingerprint(self) -> str:
        """A short hash of the action table (not the count): variants acting alike share it."""
        body = json.dumps(
            [self.checkpoint, {k: a.to_json() for k, a in sorted(self.actions.items())}],
            sort_keys=True,
        )
        return hashlib.sha256(body.encode()).hexdigest()[:12]

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "checkpoint": self.checkpoint,
            "actions": {k: a.to_json() for k, a in sorted(self.actions.items())},
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Variant:
        return cls(
            count=int(obj["count"]),
            checkpoint=bool(obj["checkpoint"]),
            actions={str(k): Action.from_json(v) for k, v in obj.get("actions", {}).items()},
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


# ----------------------------------------------------------------------------------- profiles
@dataclass
class CodecProfile:
    """One codec measured on one op's real output."""

    codec: str
    params: dict[str, Any]
    nbytes: int  # encoded bytes (exact, on the profiled activation)
    encode_ms: float
    decode_ms: float
    rel_error: float  # error on what backward reads (see codecs.relative_error)
    n_outliers: int = 0
    encode_workspace_nbytes: int = 0  # peak temporaries of one encode, beyond the payload
    decode_workspace_nbytes: int = 0  # peak temporaries of one decode, beyond its output

    @property
    def ms(self) -> float:
        return self.encode_ms + self.decode_ms


@dataclass(frozen=True)
class OpProfile(OpSpec):
    """One op of a block with its measured costs."""

    fwd_ms: float = 0.0  # time to (re)compute it
    block_output: bool = False  # an output of this op is the block's output
    codecs: dict[str, CodecProfile] = field(default_factory=dict)
    shared_nbytes: int = 0  # bytes of its outputs held anyway (by the next block, as its input)

    @property
    def retain_nbytes(self) -> int:
        return self.nbytes - self.shared_nbytes

    def spec(self) -> OpSpec:
        """The op as a policy names it (no measurements)."""
        return OpSpec(**{f.name: getattr(self, f.name) for f in fields(OpSpec)})

    @classmethod
    def from_spec(cls, spec: OpSpec, **measured: Any) -> OpProfile:
        return cls(**{f.name: getattr(spec, f.name) for f in fields(OpSpec)}, **measured)


@dataclass
class GroupProfile:
    """A block group: its ops and what a block costs as a whole (bytes per block)."""

    name: str
    num_blocks: int
    input_nbytes: int  # held by a checkpointed block whatever the policy (measured)
    full_nbytes: int  # held by a block with no checkpointing (measured)
    fixed_ms: float  # recompute time of ops that always rerun in a checkpointed block
    transient_nbytes: int  # peak of a checkpointed block's backward above the level at its start
    block_fwd_ms: float  # one block's forward, no checkpointing
    ops: list[OpProfile] = field(default_factory=list)
    plain_transient_nbytes: int = 0  # the same for a block without checkpointing
    output_nbytes: int = 0  # a block's output (the gradient its backward starts from)
    grad_nbytes: int = 0  # gradients of one block's trainable parameters (unsharded)
    positions: list[int] = field(default_factory=list)  # each block's index in forward order
    forward_transient_nbytes: int = 0  # peak of a checkpointed block's forward above its start
    plain_forward_transient_nbytes: int = 0  # the same for a block without checkpointing
    full_interior_nbytes: int = 0  # held by a plain block followed by a plain one (0: unknown)
    # runtime overhead of a checkpointed block that caches any op: every aten op of its forward
    # and recompute crossing the runtime's dispatch modes (measured; 0 in older profiles)
    dispatch_ms: float = 0.0


@dataclass
class Timeline:
    """One training step measured under full recomputation at the profiled shape: bytes above the
    level when the step starts (activations, gradients, temporaries; parameters, buffers and
    optimizer states excluded), at the moments where memory can peak. Lists are per block in
    forward order."""

    held: list[int]  # what each block's forward leaves held for backward
    forward_start: list[int]  # when block j's forward starts
    forward_peak: list[int]  # the highest during block j's forward
    backward_start: list[int]  # when block j's backward starts (its output's gradient arrived)
    backward_peak: list[int]  # the highest during block j's backward (its recompute included)
    loss_peak: int = 0  # the highest after the last block's forward (final norm, head, loss)
    head_peak: int = 0  # the highest from backward's start to the last block's backward
    tail_peak: int = 0  # the highest after the first block's backward (embeddings)
    grads: list[int] = field(default_factory=list)  # gradient bytes alive at backward_start


@dataclass
class Profile:
    """Everything the solver needs, measured on one device, dtype and micro-batch shape.

    The step's memory outside the blocks: ``nonblock_nbytes`` held for backward (of it,
    ``nonblock_before_nbytes`` created before the first block: embeddings, masks; the rest after:
    final norm, logits, loss), the forward's own temporaries above what it leaves held, and the
    backward's transients: from the loss to the last block (``head``: logits gradient, head weight
    gradient) and after the first block (``tail``: embedding gradients, tied weights).
    """

    model_type: str
    adapter: str
    adapter_version: int
    device: str
    dtype: str
    batch_shape: dict[str, list[int]]
    groups: dict[str, GroupProfile]
    nonblock_nbytes: int
    head_transient_nbytes: int = 0
    profile_ms: float = 0.0  # wall time spent profiling
    autocast: str | None = None  # the autocast dtype the profile ran under (None: off)
    nonblock_before_nbytes: int = 0
    forward_transient_nbytes: int = 0
    tail_transient_nbytes: int = 0
    nonblock_grad_nbytes: int = 0  # gradients of trainable parameters outside the blocks
    batch_nbytes: int = 0  # the micro-batch's own tensors (on the device all step long)
    timeline: Timeline | None = None  # measured; None: synthesised from the fields above
    # Measured per action table: "group:variant fingerprint" -> [forward, backward] transient
    # minus full recomputation's, on the profiled block ("group:full": full recomputation's own).
    variant_transients: dict[str, list[int]] = field(default_factory=dict)
    library_version: str = ""
    format_version: int = PROFILE_FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        d = json.loads(text)
        version = d.get("format_version", 1)
        if not isinstance(version, int) or version > PROFILE_FORMAT:
            raise PolicyError(
                f"profile format {version!r} was written by a newer adacc-hf: upgrade it, or "
                "profile again"
            )
        known_profile = {f.name for f in fields(cls)}
        known_group = {f.name for f in fields(GroupProfile)}
        known_op = {f.name for f in fields(OpProfile)}
        groups = {}
        for name, g in d.pop("groups").items():
            ops = []
            for o in g.pop("ops"):
                codecs = {k: CodecProfile(**c) for k, c in o.pop("codecs").items()}
                o = {k: v for k, v in o.items() if k in known_op}
                ops.append(OpProfile(**{**o, "shape": tuple(o["shape"])}, codecs=codecs))
            g = {k: v for k, v in g.items() if k in known_group}
            groups[name] = GroupProfile(**g, ops=ops)
        if "nonblock_transient_nbytes" in d:  # format 1
            d.setdefault("head_transient_nbytes", d.pop("nonblock_transient_nbytes"))
        d = {k: v for k, v in d.items() if k in known_profile}
        if isinstance(d.get("timeline"), dict):
            d["timeline"] = Timeline(**d["timeline"])
        return cls(**d, groups=groups)

    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups.values())

    def no_checkpoint_nbytes(self) -> int:
        """Activation bytes held with no checkpointing anywhere."""
        return self.nonblock_nbytes + sum(
            g.num_blocks * g.full_nbytes for g in self.groups.values()
        )

    @property
    def nonblock_after_nbytes(self) -> int:
        return self.nonblock_nbytes - self.nonblock_before_nbytes

    def block_order(self) -> list[tuple[str, int]]:
        """(group, index within the group) of every block, in forward order."""
        order = []
        for name, g in self.groups.items():
            positions = g.positions or [None] * g.num_blocks
            for i, pos in enumerate(positions):
                order.append((pos if pos is not None else len(order), name, i))
        return [(name, i) for _, name, i in sorted(order)]

    def full_recompute_nbytes(self) -> int:
        """Activation bytes held under full recomputation."""
        return self.nonblock_nbytes + sum(
            g.num_blocks * g.input_nbytes for g in self.groups.values()
        )
