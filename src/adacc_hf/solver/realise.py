"""Realisation: the solver's integer counts turned into a `Policy` (variants of blocks).

For a group with ``K`` checkpointed blocks and, per op, ``y[a]`` blocks applying action ``a``,
block ``j < K`` applies the ``(K-1-j)``-th action in the order of the op's cumulative counts
(retain, compress, recompute): the blocks that hold the most come last, so backward (which runs
the blocks from the last) frees them first while gradients are still few. The first ``B`` blocks
(``counts[INPUT]["offload"]``) hold their inputs in host memory: theirs stay held longest. Runs
of blocks with equal action tables share one variant, and the ``N - K`` blocks without
checkpointing form the last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..policy import Policy
from ..policy.consistency import keeps_statistics, lossy
from ..schema import ALWAYS_RETAIN, RECOMPUTE, GroupPolicy, OpProfile, Profile, Variant
from .cost_model import Choice, GroupModel, Prediction
from .offload import INPUT


@dataclass
class Solution:
    """A solved policy and the numbers the cost model predicts for it."""

    policy: Policy
    # "optimal", "feasible" (time limit), "fits" (no checkpointing), "least" (full recomputation
    # at the floor), "fallback"
    status: str
    solver: str
    solve_ms: float
    budget_nbytes: int
    static_nbytes: int
    held_nbytes: int  # activation bytes held for backward (all blocks + outside them)
    transient_nbytes: int
    peak_nbytes: int  # the step's predicted peak (cost_model.predict)
    added_ms: float  # extra time per step vs no checkpointing (the objective, no tie-breaker)
    min_budget_nbytes: int  # the smallest budget any policy fits in
    moment: str = ""  # the moment of the step that sets the peak (see solver.step)
    checkpointed: dict[str, int] = field(default_factory=dict)  # K_g per group
    counts: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)  # g -> op -> a -> y


def full_recompute_counts(
    groups: list[GroupModel], offload_inputs: bool = False
) -> tuple[dict[str, int], dict]:
    """Every block checkpointed and recomputed (`offload_inputs`: its input in host memory)."""
    ks = {gm.name: gm.prof.num_blocks for gm in groups}
    counts = {
        gm.name: {op.key: {_least(op): gm.prof.num_blocks} for op, _ in gm.ops} for gm in groups
    }
    if offload_inputs:
        for gm in groups:
            counts[gm.name][INPUT] = {"offload": gm.prof.num_blocks}
    return ks, counts


def _least(op: OpProfile) -> str:
    """Full recomputation's action for an op: recompute, or retain where nothing else is allowed
    (`ALWAYS_RETAIN` layer types)."""
    return "retain" if op.layer_type in ALWAYS_RETAIN else "recompute"


def _layouts(gm: GroupModel) -> list[list[Choice]]:
    """Each op's choices in the order blocks take them. An op with a statistic op after it
    (`policy.consistency`) takes its lossy actions last, so they fall in the blocks where the
    statistic op recomputes (it retains first): the solver keeps their counts apart
    (``lossy_j + retain_s <= K``)."""
    out: list[list[Choice]] = []
    statistic_later = False
    for op, choices in reversed(gm.ops):
        if statistic_later:
            choices = sorted(choices, key=lambda c: lossy(c.action))  # stable: lossy ones last
        out.append(choices)
        statistic_later = statistic_later or keeps_statistics(op)
    return out[::-1]


def variants(gm: GroupModel, k: int, counts: dict[str, dict[str, int]]) -> list[Variant]:
    """Block j < K applies, per op, the (K-1-j)-th action in the order of its cumulative counts
    (`_layouts`); blocks j < B offload their inputs."""
    blocks: list[tuple[str, ...]] = []
    layouts = _layouts(gm)
    inputs = counts.get(INPUT, {}).get("offload", 0)
    for j in range(k):
        labels = [INPUT] if j < inputs else []
        for (op, _), choices in zip(gm.ops, layouts, strict=True):
            acc = 0
            for c in choices:
                acc += counts[op.key].get(c.label, 0)
                if k - 1 - j < acc:
                    labels.append(c.label)
                    break
            else:
                labels.append("recompute")
        blocks.append(tuple(labels))
    by_label = {(op.key, c.label): c.action for op, cs in gm.ops for c in cs}
    variants: list[Variant] = []
    for j, labels in enumerate(blocks):
        if j and labels == blocks[j - 1]:
            variants[-1].count += 1
            continue
        actions = {op.key: RECOMPUTE for op in gm.prof.ops}
        offload_input = bool(labels) and labels[0] == INPUT
        for (op, _), label in zip(gm.ops, labels[1:] if offload_input else labels, strict=True):
            actions[op.key] = by_label.get((op.key, label), RECOMPUTE)
        variants.append(Variant(1, True, actions, offload_input))
    if gm.prof.num_blocks - k > 0 or not variants:
        variants.append(Variant(gm.prof.num_blocks - k, False, {}))
    return variants


def policy_from_counts(
    profile: Profile, groups: list[GroupModel], ks: dict[str, int], counts: dict
) -> Policy:
    return Policy(
        model_type=profile.model_type,
        adapter=profile.adapter,
        adapter_version=profile.adapter_version,
        groups={
            gm.name: GroupPolicy(
                ops=[op.spec() for op in gm.prof.ops],
                variants=variants(gm, ks[gm.name], counts[gm.name]),
                input_nbytes=gm.prof.input_nbytes,
            )
            for gm in groups
        },
    )


def solve_metadata(
    profile: Profile, sol: Solution, pred: Prediction, spec: str, how: str, split_blocks: bool
) -> dict[str, Any]:
    per_group: dict[str, list[dict[str, Any]]] = {}
    for name, gp in sol.policy.groups.items():
        blocks, i, rows = pred.per_block[name], 0, []
        for v in gp.variants:
            rows.append(
                {
                    "count": v.count,
                    "checkpoint": v.checkpoint,
                    "held_nbytes_per_block": blocks[i] if v.count else 0,
                }
            )
            i += v.count
        per_group[name] = rows
    return {
        "source": "milp",
        "solver": sol.solver,
        "status": sol.status,
        "solve_ms": round(sol.solve_ms, 3),
        "split_blocks": split_blocks,
        "budget_nbytes": sol.budget_nbytes,
        "budget_spec": spec,
        "budget_how": how,
        "static_nbytes": sol.static_nbytes,
        "predicted": {
            "held_nbytes": sol.held_nbytes,
            "groups": per_group,
            "transient_nbytes": sol.transient_nbytes,
            "peak_nbytes": sol.peak_nbytes,
            "peak_moment": pred.moment,
            "added_ms": sol.added_ms,
            "min_budget_nbytes": sol.min_budget_nbytes,
            "grad_error": pred.grad_error,
        },
        "profile": {
            "device": profile.device,
            "dtype": profile.dtype,
            "batch_shape": profile.batch_shape,
        },
    }
