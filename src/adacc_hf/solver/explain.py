"""Why a plan left an op uncompressed: the question a GPU run asks of a plan that compresses
nothing (`not_compressed`)."""

from __future__ import annotations

from typing import Any

from ..policy.consistency import keeps_statistics
from ..schema import ALWAYS_RETAIN, Profile, codec_can_pay

__all__ = ["REASONS", "not_compressed"]

#: The reasons `not_compressed` gives, from the op's nature to the solver's choice.
REASONS = {
    "no codec": "no codec applies (a statistic, a small or integer output)",
    "never": "kept exact by rule (a router, or statistics beside lossy outputs)",
    "slower": "every codec is slower than recomputing the op",
    "error": "every codec that could pay is over the gradient-error bound",
    "not needed": "its memory was not needed: retained, or in a block that is not checkpointed",
    "overhead": "no checkpointed block keeps anything: the runtime's dispatch overhead of a block "
    "that keeps an op costs more than keeping saves",
    "solver": "another action was cheaper for the memory it saves (recompute or offload)",
}


def not_compressed(
    profile: Profile, policy: Any, max_grad_error: float | None = None
) -> dict[str, dict[str, str]]:
    """Per group, each cacheable op no block of `policy` compresses, and why (`REASONS` keys):
    the first reason that holds, in the order of `REASONS`."""
    out: dict[str, dict[str, str]] = {}
    for name, g in profile.groups.items():
        gp = policy.groups.get(name)
        if gp is None:
            continue
        variants = [v for v in gp.variants if v.count]
        keeps = any(a.keeps for v in variants if v.checkpoint for a in v.actions.values())
        reasons: dict[str, str] = {}
        for op in g.ops:
            if not op.cacheable or op.block_output:
                continue
            acts = [v.action(op.key) for v in variants if v.checkpoint]
            if any(a.kind == "compress" or (a.kind == "offload" and a.codec) for a in acts):
                continue
            if not op.codecs:
                reasons[op.key] = "no codec"
            elif op.layer_type in ALWAYS_RETAIN or keeps_statistics(op):
                reasons[op.key] = "never"
            elif not any(codec_can_pay(op, cp) for cp in op.codecs.values()):
                reasons[op.key] = "slower"
            elif max_grad_error is not None and all(
                (cp.grad_error or 0.0) > max_grad_error
                for cp in op.codecs.values()
                if codec_can_pay(op, cp)
            ):
                reasons[op.key] = "error"
            elif all(a.kind == "retain" for a in acts):
                reasons[op.key] = "not needed"
            elif not keeps and g.dispatch_ms > 0:
                reasons[op.key] = "overhead"
            else:
                reasons[op.key] = "solver"
        out[name] = reasons
    return out
