"""The budget the solver plans for: the user's budget less what the step model cannot see.

The step model predicts a dense model's step to the byte where memory is counted exactly (CPU:
every codec payload has a fixed size, `Codec.predict_nbytes`, and the tests meter whole steps
against it). Two things it cannot see, and only they get a headroom kept free:

* CUDA's caching allocator rounds and fragments (the `guard` learns the rest after a step, and
  `oom` after an out-of-memory);
* a mixture-of-experts block routes a different number of tokens to each expert batch to batch,
  and the profile measured one batch's routing;
* a model compiled whole (`profiler.compiled`): its blocks, head and whole step are measured
  under a few policies, not op by op, and a plan between them is predicted within a few per cent
  (the tiny llama with no checkpointing: 1.7 % over), so even the plan without checkpointing keeps
  the headroom.

A plan with neither is solved against the whole budget: a headroom there only shuts out plans
that fit (transformers' ``every_n_layers=4`` on a 135M LLaMA, 240.7 MiB measured against a
244.4 MiB budget, was one).
"""

from __future__ import annotations

from ..schema import ALWAYS_RETAIN, Profile
from .static import StaticMemory
from .step import extreme_peaks
from .window import candidate_heads

#: Share of the activation budget (budget - static) left free where the step model is not exact
#: (`headroom_for`).
HEADROOM = 0.03


def varies(profile: Profile) -> str:
    """Why a step planned from `profile` may hold more than predicted ("" when it is exact: a
    dense model on a CPU, fp32 or under autocast, with or without gradient accumulation and the
    chunked head; the tests meter those steps to the byte)."""
    if profile.compiled:
        return "a compiled model is measured in parts and whole, not op by op"
    if profile.device.startswith("cuda"):
        return "CUDA's caching allocator rounds and fragments"
    if any(op.layer_type in ALWAYS_RETAIN for g in profile.groups.values() for op in g.ops):
        return "expert routing differs from batch to batch"
    return ""


def headroom_for(profile: Profile) -> float:
    """The default headroom (`AdaccConfig.headroom=None`): `HEADROOM` where `varies`, else 0."""
    return HEADROOM if varies(profile) else 0.0


def planned_budget(
    budget_nbytes: int,
    static: int | StaticMemory,
    profile: Profile,
    headroom: float | None = None,
    accumulation: int = 1,
    head: str = "full",
    reserve: int = 0,
) -> int:
    """The budget to solve for: `reserve` bytes below the budget (what the device showed it does
    not hold: `engine.guard`, `engine.oom`), and `headroom` (None: `headroom_for`) of
    the share left after static memory kept free, unless that fits no checkpointing at all
    (nothing data-dependent then; not for a compiled profile), with the LM head run as `head`
    (or any measured way for "auto"). Never below the least step peak where the budget itself
    holds it: at the tight end only the policies holding the least fit, and the step model
    predicts them as measured, so the budget below full recomputation's peak stays free rather
    than filled with what the headroom was meant to cover; and a reserve larger than the
    activation share leaves full recomputation, not an infeasible plan."""
    if headroom is None:
        headroom = headroom_for(profile)
    peaks = [
        extreme_peaks(profile, static, accumulation, h) for h in candidate_heads(profile, head)
    ]
    low = min(p[0].peak_nbytes for p in peaks)
    room = budget_nbytes - max(0, reserve)
    if room >= min(p[1].peak_nbytes for p in peaks) and not profile.compiled:
        return room
    total = static.total if isinstance(static, StaticMemory) else int(static)
    planned = room - int(max(0, room - total) * headroom)
    return min(budget_nbytes, max(planned, low))
