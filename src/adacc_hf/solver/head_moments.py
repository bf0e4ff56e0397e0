"""The LM head's moments in the step timeline with the chosen way of running the head.

The timeline (`Profile.timeline`) was measured with the model's own head; a plan may run another
(`schema.HEADS`: the chunked head holds no logits). Its moments move by the difference of the two
heads measured alone (`Profile.heads`).
"""

from __future__ import annotations

from ..schema import HeadCost, Profile, Timeline


def head_shift(profile: Profile, head: str) -> HeadCost:
    """`head`'s measured cost minus the model's own (``"full"``, what the timeline measured);
    zero where either was not measured."""
    own, chosen = profile.heads.get("full"), profile.heads.get(head)
    if head == "full" or own is None or chosen is None:
        return HeadCost(0, 0, 0, 0.0)
    return HeadCost(
        chosen.held - own.held,
        chosen.forward_peak - own.forward_peak,
        chosen.backward_peak - own.backward_peak,
        chosen.ms - own.ms,
    )


def forward_end(profile: Profile, tl: Timeline, head: str) -> int:
    """The timeline's level when forward ends (the loss computed), `head` in place of the model's
    own: what the head holds for its backward moves it (the model's logits, or nothing)."""
    return tl.loss_peak - profile.forward_transient_nbytes + head_shift(profile, head).held


def head_peaks(profile: Profile, tl: Timeline, head: str) -> tuple[int, int]:
    """The timeline's (loss_peak, head_peak) with `head` in place of the model's own: each moves
    by the head's peak difference, and stays at least the level forward ends at."""
    shift = head_shift(profile, head)
    end = forward_end(profile, tl, head)
    return (
        max(tl.loss_peak + shift.forward_peak, end),
        max(tl.head_peak + shift.backward_peak, end),
    )
