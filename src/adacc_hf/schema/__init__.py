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

from .ops import (
    ACTION_KINDS,
    ALWAYS_RETAIN,
    ATTENTION_CORE,
    CODEC_FOR_LAYER,
    FLOAT_DTYPES,
    HEADS,
    LAYER_TYPES,
    MIN_COMPRESS_CHANNELS,
    MIN_COMPRESS_NUMEL,
    POLICY_FORMAT,
    PROFILE_FORMAT,
    RECOMPUTE,
    RETAIN,
    Action,
    ActionKind,
    BlockTrace,
    GroupPolicy,
    ModelTrace,
    OpSpec,
    Variant,
    codec_candidates,
    variant_key,
)
from .profiles import (
    CodecProfile,
    GroupProfile,
    HeadCost,
    OffloadLink,
    OpProfile,
    Profile,
    Timeline,
    codec_can_pay,
)

__all__ = [
    "ACTION_KINDS",
    "ALWAYS_RETAIN",
    "ATTENTION_CORE",
    "CODEC_FOR_LAYER",
    "FLOAT_DTYPES",
    "HEADS",
    "LAYER_TYPES",
    "MIN_COMPRESS_CHANNELS",
    "MIN_COMPRESS_NUMEL",
    "POLICY_FORMAT",
    "PROFILE_FORMAT",
    "RECOMPUTE",
    "RETAIN",
    "Action",
    "ActionKind",
    "BlockTrace",
    "CodecProfile",
    "GroupPolicy",
    "GroupProfile",
    "HeadCost",
    "ModelTrace",
    "OffloadLink",
    "OpProfile",
    "OpSpec",
    "Profile",
    "Timeline",
    "Variant",
    "codec_can_pay",
    "codec_candidates",
    "variant_key",
]
