"""The per-op policy: for every op of a block, retain its output, compress it, or recompute it.

A `Policy` is a versioned, serialisable artifact. It holds, per block group, the ordered op list of
one block (from a trace: key, layer type, shape, dtype, bytes) and one or more *variants*: runs of
consecutive blocks that share an action table. A variant with ``checkpoint=False`` runs its blocks
with no checkpoint machinery at all (everything autograd saves is retained, zero overhead).

Op keys look like ``"self_attn.q_proj/mm#0"``: the submodule the op runs in (relative to the block;
``""`` for the block's own code), the aten op, and its occurrence index there.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from . import __version__
from .adapters import ATTENTION_CORE, CODEC_FOR_LAYER, LAYER_TYPES, get_adapter
from .errors import PolicyError

if TYPE_CHECKING:
    from torch import nn

    from .runtime.trace import ModelTrace

FORMAT_VERSION = 1
# Outputs smaller than this (per-row statistics, scalars) are kept exact by uniform compression.
MIN_COMPRESS_CHANNELS = 8
MIN_COMPRESS_NUMEL = 256
ActionKind = Literal["retain", "recompute", "compress"]
_KINDS = ("retain", "recompute", "compress")


@dataclass(frozen=True)
class Action:
    """What happens to one op's output: ``retain``, ``recompute`` or ``compress`` with a codec."""

    kind: ActionKind
    codec: str | None = None
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise PolicyError(f"unknown action {self.kind!r}; use one of {', '.join(_KINDS)}")
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


@dataclass(frozen=True)
class OpSpec:
    """One op of a block, as traced: its key and what its output is."""

    key: str
    layer_type: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    saved: bool  # autograd keeps this output for backward when nothing is checkpointed
    cacheable: bool  # False for outputs that are mutated in place or come from an RNG op

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "layer_type": self.layer_type,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "nbytes": self.nbytes,
            "saved": self.saved,
            "cacheable": self.cacheable,
        }

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
        )


@dataclass
class Variant:
    """`count` consecutive blocks of a group that share one action table."""

    count: int
    checkpoint: bool
    actions: dict[str, Action] = field(default_factory=dict)

    def action(self, key: str) -> Action:
        return self.actions.get(key, Action.recompute())

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


@dataclass
class Policy:
    """Per-op actions for every block of a model, plus where they came from.

    Build one with `Policy.uniform`, `Policy.attention_recompute`, `Policy.from_actions` or the
    solver; apply it with `adacc_hf.apply_adacc`; save it with `to_json` / `save`.
    """

    model_type: str
    adapter: str
    groups: dict[str, GroupPolicy]
    metadata: dict[str, Any] = field(default_factory=dict)
    adapter_version: int = 1
    library_version: str = __version__
    format_version: int = FORMAT_VERSION

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_trace(
        cls,
        trace: ModelTrace,
        choose: Any,
        *,
        source: str,
        checkpoint: bool = True,
        metadata: dict[str, Any] | None = None,
    ) -> Policy:
        """A single-variant policy: ``choose(op: OpSpec) -> Action`` for every cacheable op."""
        groups = {}
        for name, bt in trace.groups.items():
            actions = {}
            if checkpoint:
                for op in bt.ops:
                    actions[op.key] = choose(op) if op.cacheable else Action.recompute()
            groups[name] = GroupPolicy(
                ops=list(bt.ops),
                variants=[Variant(bt.num_blocks, checkpoint, actions)],
                input_nbytes=bt.input_nbytes,
            )
        meta = {"source": source, **(metadata or {})}
        return cls(
            model_type=trace.model_type,
            adapter=trace.adapter,
            adapter_version=trace.adapter_version,
            groups=groups,
            metadata=meta,
        )

    @classmethod
    def uniform(
        cls,
        model: nn.Module,
        action: ActionKind,
        sample_batch: Mapping[str, Any] | None = None,
        *,
        codecs: Mapping[str, str] | None = None,
        codec_params: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> Policy:
        """The same action for every op of every block.

        ``"retain"`` runs every block without checkpointing; ``"recompute"`` is full activation
        checkpointing; ``"compress"`` compresses every output that autograd keeps with its layer
        type's codec (override with ``codecs={layer_type: codec}``) and recomputes the rest.
        """
        if action not in _KINDS:
            raise PolicyError(f"unknown action {action!r}; use one of {', '.join(_KINDS)}")
        trace = _trace(model, sample_batch)
        if action == "retain":
            return cls.from_trace(trace, None, source="uniform:retain", checkpoint=False)
        if action == "recompute":
            return cls.from_trace(trace, lambda op: Action.recompute(), source="uniform:recompute")
        pick = _codec_picker(codecs, codec_params)
        return cls.from_trace(
            trace,
            lambda op: pick(op) if op.saved else Action.recompute(),
            source="uniform:compress",
        )

    @classmethod
    def by_layer_type(
        cls,
        model: nn.Module,
        actions: Mapping[str, ActionKind],
        sample_batch: Mapping[str, Any] | None = None,
        *,
        default: ActionKind = "retain",
        source: str = "by_layer_type",
    ) -> Policy:
        """One action per layer type (see `adacc_hf.adapters.LAYER_TYPES`); `default` for the rest.

        ``retain`` keeps only outputs autograd saves (others are recomputed for free);
        ``compress`` uses each layer type's codec.
        """
        unknown = sorted(set(actions) - set(LAYER_TYPES))
        if unknown:
            raise PolicyError(f"unknown layer types {unknown}; known: {', '.join(LAYER_TYPES)}")
        pick = _codec_picker(None, None)

        def choose(op: OpSpec) -> Action:
            kind = actions.get(op.layer_type, default)
            if kind == "recompute" or not op.saved:
                return Action.recompute()
            return pick(op) if kind == "compress" else Action(kind)

        return cls.from_trace(_trace(model, sample_batch), choose, source=source)

    @classmethod
    def attention_recompute(
        cls, model: nn.Module, sample_batch: Mapping[str, Any] | None = None
    ) -> Policy:
        """Megatron-style selective recompute: recompute the attention core, retain what autograd
        keeps everywhere else."""
        return cls.by_layer_type(
            model,
            dict.fromkeys(ATTENTION_CORE, "recompute"),
            sample_batch,
            source="attention_recompute",
        )

    @classmethod
    def random(
        cls,
        model: nn.Module,
        sample_batch: Mapping[str, Any] | None = None,
        *,
        seed: int = 0,
        kinds: Iterable[ActionKind] = ("retain", "recompute"),
    ) -> Policy:
        """A random mix of actions (for tests): each cacheable op draws one of `kinds`."""
        rng = random.Random(seed)
        kinds = tuple(kinds)
        trace = _trace(model, sample_batch)
        pick = _codec_picker(None, None)

        def choose(op: OpSpec) -> Action:
            kind = rng.choice(kinds)
            return pick(op) if kind == "compress" else Action(kind)

        return cls.from_trace(trace, choose, source=f"random:{seed}")

    # ---------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "adacc_hf_policy_format": self.format_version,
            "library_version": self.library_version,
            "model_type": self.model_type,
            "adapter": self.adapter,
            "adapter_version": self.adapter_version,
            "groups": {k: g.to_json() for k, g in sorted(self.groups.items())},
            "metadata": self.metadata,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, obj: Any) -> Policy:
        if not isinstance(obj, dict):
            raise PolicyError("an adacc policy is a JSON object; this file holds something else")
        version = obj.get("adacc_hf_policy_format")
        if version is None:
            raise PolicyError("not an adacc-hf policy: the 'adacc_hf_policy_format' key is missing")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise PolicyError(
                f"policy format {version!r} was written by a newer adacc-hf "
                f"({obj.get('library_version')}); this is {__version__} (format {FORMAT_VERSION}): "
                "upgrade adacc-hf, or re-create the policy"
            )
        known = {
            "adacc_hf_policy_format",
            "library_version",
            "model_type",
            "adapter",
            "adapter_version",
            "groups",
            "metadata",
        }
        unknown = sorted(set(obj) - known)
        if unknown:
            warnings.warn(f"ignoring unknown policy keys {unknown}", stacklevel=2)
        try:
            groups = {str(k): GroupPolicy.from_json(g) for k, g in obj["groups"].items()}
            return cls(
                model_type=str(obj["model_type"]),
                adapter=str(obj["adapter"]),
                adapter_version=int(obj.get("adapter_version", 1)),
                library_version=str(obj.get("library_version", "?")),
                format_version=version,
                groups=groups,
                metadata=dict(obj.get("metadata", {})),
            )
        except PolicyError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PolicyError(f"corrupt adacc policy: {type(e).__name__}: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> Policy:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise PolicyError(
                f"the policy is not valid JSON ({e}); re-create or re-save it"
            ) from None
        policy = cls.from_dict(obj)
        policy.check()
        return policy

    @classmethod
    def load(cls, path: str) -> Policy:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise PolicyError(f"cannot read policy file {path!r}: {e}") from None
        try:
            return cls.from_json(text)
        except PolicyError as e:
            raise PolicyError(f"{path}: {e}") from None

    def __copy__(self) -> Policy:
        return Policy.from_dict(copy.deepcopy(self.to_dict()))

    def __deepcopy__(self, memo: dict) -> Policy:
        return self.__copy__()

    def fingerprint(self) -> str:
        """A short hash of the actions (not the metadata): equal on every rank running it."""
        body = {k: g.to_json() for k, g in sorted(self.groups.items())}
        text = json.dumps([self.model_type, body], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------- validation
    def check(self) -> None:
        """Internal consistency: known codecs, actions only for known ops, non-cacheable ops
        recomputed."""
        from .codecs import CodecError, get_codec

        if not self.groups:
            raise PolicyError("the policy has no block groups")
        for name, g in self.groups.items():
            keys = {o.key for o in g.ops}
            if not g.variants or any(v.count < 0 for v in g.variants):
                raise PolicyError(f"group {name!r}: needs variants with non-negative counts")
            for v in g.variants:
                extra = sorted(set(v.actions) - keys)
                if extra:
                    raise PolicyError(
                        f"group {name!r}: actions for unknown ops {extra[:5]}; this policy is "
                        "corrupt or was edited by hand"
                    )
                for key, act in v.actions.items():
                    spec = g.op(key)
                    if act.kind != "recompute" and spec is not None and not spec.cacheable:
                        raise PolicyError(
                            f"group {name!r}: op {key} is mutated in place or random; it can only "
                            f"be recomputed, not {act}"
                        )
                    if act.kind == "compress":
                        try:
                            get_codec(act.codec, **dict(act.params))
                        except CodecError as e:
                            raise PolicyError(f"group {name!r}, op {key}: {e}") from None

    def validate(self, model: nn.Module) -> None:
        """Raise `PolicyError` if this policy was not made for `model`'s family and structure."""
        self.check()
        adapter = get_adapter(model)
        from .adapters.registry import _base_model

        base = _base_model(model)
        model_type = base.config.model_type
        if model_type != self.model_type:
            raise PolicyError(
                f"this policy was made for a {self.model_type!r} model, not {model_type!r}: "
                "create a policy for this model (profile and solve, or Policy.uniform)"
            )
        if adapter.name != self.adapter:
            raise PolicyError(f"policy adapter {self.adapter!r} != model adapter {adapter.name!r}")
        groups = {g.name: len(g.modules) for g in adapter.block_groups(base)}
        mine = {k: g.num_blocks for k, g in self.groups.items()}
        if groups != mine:
            raise PolicyError(
                f"the policy's blocks {mine} do not match the model's {groups} (a different "
                "depth or architecture): create a policy for this model"
            )

    # --------------------------------------------------------------------- display
    def table(self) -> str:
        """A human-readable per-op table (one per group and variant)."""
        lines = []
        for name, g in sorted(self.groups.items()):
            for vi, v in enumerate(g.variants):
                if v.count == 0:
                    continue
                head = f"[{name}] {v.count} block(s)"
                if len(g.variants) > 1:
                    head += f", variant {vi}"
                if not v.checkpoint:
                    lines.append(head + ": no checkpointing (every activation retained)")
                    continue
                lines.append(head + f": block input {g.input_nbytes / 2**20:.2f} MiB retained")
                lines.append(f"  {'op':44s} {'layer type':13s} {'shape':22s} {'MiB':>8s}  action")
                for op in g.ops:
                    act = v.action(op.key)
                    shape = "x".join(str(s) for s in op.shape)
                    lines.append(
                        f"  {op.key:44s} {op.layer_type:13s} {shape:22s} "
                        f"{op.nbytes / 2**20:8.3f}  {act}"
                    )
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        """Counts of each action per group (for logs and model cards)."""
        out: dict[str, Any] = {}
        for name, g in sorted(self.groups.items()):
            counts: dict[str, int] = {}
            for v in g.variants:
                if not v.checkpoint:
                    counts["no_checkpoint_blocks"] = counts.get("no_checkpoint_blocks", 0) + v.count
                    continue
                for op in g.ops:
                    kind = str(v.action(op.key)).split("(")[0]
                    counts[kind] = counts.get(kind, 0) + v.count
            out[name] = counts
        return out


def _trace(model: nn.Module, sample_batch: Mapping[str, Any] | None) -> ModelTrace:
    from .runtime.trace import trace_model

    return trace_model(model, sample_batch)


def _codec_picker(
    codecs: Mapping[str, str] | None, codec_params: Mapping[str, Mapping[str, Any]] | None
):
    """Action choosing each op's codec by layer type (bool masks are bit-packed)."""
    table = {**CODEC_FOR_LAYER, **(codecs or {})}
    params = codec_params or {}

    def pick(op: OpSpec) -> Action:
        if op.dtype == "torch.bool":
            return Action.compress("bitpack")
        numel = 1
        for s in op.shape:
            numel *= s
        small = not op.shape or op.shape[-1] < MIN_COMPRESS_CHANNELS or numel < MIN_COMPRESS_NUMEL
        if small or op.dtype not in ("torch.float32", "torch.float16", "torch.bfloat16"):
            return Action.retain()  # statistics, masks of other dtypes: exact and small
        codec = table.get(op.layer_type, "int4_outlier")
        return Action.compress(codec, **dict(params.get(codec, {})))

    return pick
