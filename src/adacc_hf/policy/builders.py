"""Policies built from a `ModelTrace` by a rule (no profile, no solver).

`adacc_hf.uniform_policy` & co. trace a model and call these; tests and benchmarks use them to
build fixed policies. ``random_mix`` is a test helper: every cacheable op draws an action.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import PolicyError
from ..schema import (
    ACTION_KINDS,
    ALWAYS_RETAIN,
    ATTENTION_CORE,
    LAYER_TYPES,
    RECOMPUTE,
    RETAIN,
    Action,
    ActionKind,
    GroupPolicy,
    ModelTrace,
    OpSpec,
    Variant,
    codec_candidates,
)
from .consistency import repair_actions
from .core import Policy

Chooser = Callable[[OpSpec], Action]


def from_trace(
    trace: ModelTrace,
    choose: Chooser | None,
    *,
    source: str,
    checkpoint: bool = True,
    metadata: dict[str, Any] | None = None,
    offload_input: bool = False,
) -> Policy:
    """A single-variant policy: ``choose(op) -> Action`` for every cacheable op (``checkpoint=
    False``: no checkpointing, ``choose`` unused; `offload_input`: every block's input held in
    host memory). Ops of `ALWAYS_RETAIN` layer types (MoE
    routers) are retained whatever ``choose`` says; statistic ops after a lossy op are recomputed
    (`consistency`)."""
    groups = {}
    for name, bt in trace.groups.items():
        actions: dict[str, Action] = {}
        if checkpoint:
            assert choose is not None
            for op in bt.ops:
                if not op.cacheable:
                    actions[op.key] = RECOMPUTE
                elif op.layer_type in ALWAYS_RETAIN:
                    actions[op.key] = RETAIN
                else:
                    actions[op.key] = choose(op)
            actions, _ = repair_actions(bt.ops, actions)  # no lossy input beside a statistic
        groups[name] = GroupPolicy(
            ops=list(bt.ops),
            variants=[Variant(bt.num_blocks, checkpoint, actions, checkpoint and offload_input)],
            input_nbytes=bt.input_nbytes,
        )
    return Policy(
        model_type=trace.model_type,
        adapter=trace.adapter,
        adapter_version=trace.adapter_version,
        groups=groups,
        metadata={"source": source, **(metadata or {})},
    )


def codec_picker(
    codecs: Mapping[str, str] | None = None,
    codec_params: Mapping[str, Mapping[str, Any]] | None = None,
) -> Chooser:
    """Compress with the layer type's codec (``codecs={layer_type: codec}`` overrides), bit-pack
    bool masks, retain what no codec may touch (small statistics, integer outputs)."""
    table = dict(codecs or {})
    params = codec_params or {}

    def pick(op: OpSpec) -> Action:
        names = codec_candidates(op)
        if not names:
            return Action.retain()
        codec = table.get(op.layer_type, names[0]) if names[0] != "bitpack" else "bitpack"
        return Action.compress(codec, **dict(params.get(codec, {})))

    return pick


def uniform(
    trace: ModelTrace,
    action: ActionKind,
    *,
    codecs: Mapping[str, str] | None = None,
    codec_params: Mapping[str, Mapping[str, Any]] | None = None,
) -> Policy:
    """The same action for every op of every block.

    ``"retain"`` runs every block without checkpointing; ``"recompute"`` is full activation
    checkpointing; ``"compress"`` compresses every output autograd keeps with its layer type's
    codec (``codecs={layer_type: codec}`` overrides) and recomputes the rest; ``"offload"``
    holds every output autograd keeps and every block's input in host memory (as they are) and
    recomputes the rest.
    """
    if action not in ACTION_KINDS:
        raise PolicyError(f"unknown action {action!r}; use one of {', '.join(ACTION_KINDS)}")
    if action == "retain":
        return from_trace(trace, None, source="uniform:retain", checkpoint=False)
    if action == "recompute":
        return from_trace(trace, lambda op: RECOMPUTE, source="uniform:recompute")
    if action == "offload":
        return from_trace(
            trace,
            lambda op: Action.offload() if op.saved else RECOMPUTE,
            source="uniform:offload",
            offload_input=True,
        )
    pick = codec_picker(codecs, codec_params)
    return from_trace(
        trace, lambda op: pick(op) if op.saved else RECOMPUTE, source="uniform:compress"
    )


def by_layer_type(
    trace: ModelTrace,
    actions: Mapping[str, ActionKind],
    *,
    default: ActionKind = "retain",
    source: str = "by_layer_type",
) -> Policy:
    """One action per layer type (see `LAYER_TYPES`); `default` for the rest. ``retain`` keeps
    only outputs autograd saves (the others are recomputed for free); ``compress`` uses each layer
    type's codec."""
    unknown = sorted(set(actions) - set(LAYER_TYPES))
    if unknown:
        raise PolicyError(f"unknown layer types {unknown}; known: {', '.join(LAYER_TYPES)}")
    pick = codec_picker()

    def choose(op: OpSpec) -> Action:
        kind = actions.get(op.layer_type, default)
        if kind == "recompute" or not op.saved:
            return RECOMPUTE
        return pick(op) if kind == "compress" else Action(kind)

    return from_trace(trace, choose, source=source)


def attention_recompute(trace: ModelTrace) -> Policy:
    """Megatron-style selective recompute: recompute the attention core, retain what autograd
    keeps everywhere else."""
    return by_layer_type(
        trace, dict.fromkeys(ATTENTION_CORE, "recompute"), source="attention_recompute"
    )


def random_mix(
    trace: ModelTrace, *, seed: int = 0, kinds: Iterable[ActionKind] = ("retain", "recompute")
) -> Policy:
    """Test helper: each cacheable op draws one of `kinds` (compress: its layer type's codec)."""
    rng = random.Random(seed)
    kinds = tuple(kinds)
    pick = codec_picker()

    def choose(op: OpSpec) -> Action:
        kind = rng.choice(kinds)
        return pick(op) if kind == "compress" else Action(kind)

    return from_trace(trace, choose, source=f"random:{seed}")
