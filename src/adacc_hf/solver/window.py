"""The range of budgets that matters for a profile: the least step peak any policy reaches (full
recomputation, or with block inputs offloaded where the profile has a host link) up to the peak
without checkpointing, the LM heads a solve weighs, and where a budget sits in between."""

from __future__ import annotations

from ..errors import PolicyError
from ..schema import HEADS, Profile
from ..units import fmt_bytes
from .static import StaticMemory
from .step import extreme_peaks


def min_budget(
    profile: Profile, static: int | StaticMemory = 0, accumulation: int = 1, head: str = "full"
) -> int:
    """The smallest budget any policy fits in: the least step peak (`step.extreme_peaks`), with
    the LM head run as `head` (``"auto"``: the least of the measured ones)."""
    return min(
        extreme_peaks(profile, static, accumulation, h)[0].peak_nbytes
        for h in candidate_heads(profile, head)
    )


def candidate_heads(profile: Profile, head: str) -> list[str]:
    """The ways of running the LM head a solve for `head` weighs: ``"auto"``: every one the
    profile measured (the model's own when none); otherwise `head` itself, which must have been
    measured unless it is the model's own (``"full"``)."""
    if head == "auto":
        return [h for h in HEADS if h in profile.heads] or ["full"]
    if head not in HEADS:
        raise PolicyError(f"unknown head {head!r}: 'auto' or one of {list(HEADS)}")
    if head != "full" and head not in profile.heads:
        raise PolicyError(
            f"the profile has no measurement of the {head!r} LM head: the model cannot take it "
            "(see adacc_hf.runtime.head.chunked_head_problem) or the profile predates it"
        )
    return [head]


def no_checkpoint_budget(
    profile: Profile, static: int | StaticMemory = 0, accumulation: int = 1
) -> int:
    """The budget above which nothing needs checkpointing: the step peak with none."""
    return extreme_peaks(profile, static, accumulation)[1].peak_nbytes


def budget_between(
    profile: Profile, static: int | StaticMemory, fraction: float, accumulation: int = 1
) -> int:
    """The budget `fraction` of the way from the least step peak (0: full recomputation) to the
    peak without checkpointing (1)."""
    low, high = extreme_peaks(profile, static, accumulation)
    return int(low.peak_nbytes + fraction * (high.peak_nbytes - low.peak_nbytes))


def budget_window(
    profile: Profile,
    static: int | StaticMemory,
    budget: int,
    accumulation: int = 1,
    head: str = "full",
) -> str:
    """Where `budget` sits in the range that matters, one line: the least step peak any policy
    reaches (below it nothing fits) and the peak with no checkpointing (at or above it Adacc
    changes nothing)."""
    low, high = (
        e.peak_nbytes for e in extreme_peaks(profile, static, accumulation, head)
    )  # fmt: skip
    where = (
        "at or above no checkpointing's peak: nothing is checkpointed (a smaller budget makes "
        "Adacc save memory)"
        if budget >= high
        else "below the least peak: no policy fits"
        if budget < low
        else f"{(budget - low) / max(1, high - low):.0%} of the way from the least to no "
        "checkpointing's"
    )
    return (
        f"budget {fmt_bytes(budget)}; step peak: least {fmt_bytes(low)} (any policy), "
        f"no checkpointing {fmt_bytes(high)}; the budget is {where}"
    )
