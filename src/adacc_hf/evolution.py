"""The rectifier: re-measure codec ratios and errors during training, re-solve when they drift.

Outlier statistics move early in training and settle later, so tracking follows an exponential
backoff: tracking steps 1, 2, 4, 8, ... apart, up to `max_interval` (reset to 1 when the policy
changes). On a tracking step the runtime hands every op that has a profiled codec the solver could
choose to an `OutlierTracker` during that step's normal forward (no extra forward): the codec's
encoded size and error are measured on the live activation of every checkpointed block. The worst
errors and the outlier counts accumulate on the device until the step is over and are read in one
transfer (the training step itself never waits for the device). `apply_stats` folds them into a
copy of the `Profile`, which the solver turns into the next policy.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from .codecs import Codec, dtype_named, get_codec, relative_error
from .codecs.base import ERROR_CHUNK
from .policy import Policy
from .runtime.ops import cache_target
from .schema import CodecProfile, OpProfile, Profile, codec_can_pay
from .solver import HEADROOM, StaticMemory, predict


@dataclass
class TrackingSchedule:
    """Which optimizer steps are tracking steps: 1, 2, 4, ... apart, capped at `max_interval`."""

    max_interval: int = 1024
    next_step: int = 1
    interval: int = 1
    history: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_interval < 1:
            raise ValueError(f"max_interval must be >= 1, got {self.max_interval}")

    def is_tracking_step(self, step: int) -> bool:
        return step >= self.next_step

    def advance(self, step: int, changed: bool) -> None:
        """Schedule the next tracking step after tracking at `step`."""
        self.history.append(step)
        if changed:
            self.interval = 1
        self.next_step = step + self.interval
        self.interval = min(self.interval * 2, self.max_interval)

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_interval": self.max_interval,
            "next_step": self.next_step,
            "interval": self.interval,
            "history": list(self.history),
        }

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> TrackingSchedule:
        return cls(**d)


_ROW_NBYTES = 8  # one tracked (op, codec): its worst error and outlier count, float32
_GRANULE = {"cuda": 512}  # the caching allocator's smallest block

#: Bytes per element of one `relative_error` piece alive at once (float32 copies of the input and
#: the decoded piece, their masks, the masked difference and its square).
_ERROR_BYTES_PER_ELEMENT = 20


def tracking_nbytes(op: OpProfile, cp: CodecProfile) -> int:
    """The most measuring codec `cp` on op `op`'s output allocates at once on a tracking step: the
    payload, then beside it the encode's workspace, or the decoded copy beside the decode's
    workspace or the error's pieces."""
    pieces = min(op.numel, ERROR_CHUNK) * _ERROR_BYTES_PER_ELEMENT
    decoded = op.numel * dtype_named(op.dtype).itemsize + max(cp.decode_workspace_nbytes, pieces)
    return cp.nbytes + max(cp.encode_workspace_nbytes, decoded)


def tracking_room(
    profile: Profile, policy: Policy, static: StaticMemory, accumulation: int, budget_nbytes: int
) -> tuple[int, int]:
    """What a tracking step under `policy` may hold all step long (the budget above its predicted
    peak: `OutlierTracker`'s ``room``) and allocate at once mid-forward (above its highest
    block-forward moment: ``forward_room``)."""
    pred = predict(profile, policy, static, accumulation, measured_ms=False)
    forward = max((v for k, v in pred.moments.items() if k.startswith("forward:")), default=0)
    return max(0, budget_nbytes - pred.peak_nbytes), max(0, budget_nbytes - forward)


def tracking_room_cap(budget_nbytes: int, static: StaticMemory) -> int:
    """The most an adaptive session's plan keeps free for its tracking steps (`tracking_need`):
    `HEADROOM` of the room above static memory (a measurement takes up to ~6x its op's output:
    the payload, a decoded copy, the error's float32 pieces; what does not fit waits for a plan
    with more room)."""
    return int(HEADROOM * max(0, budget_nbytes - static.total))


def tracking_need(profile: Profile, policy: Policy) -> int:
    """What a tracking step needs beside `policy`'s peak to re-measure every lossy codec the
    policy runs (the largest such measurement, and the stats buffer of every tracked codec): an
    adaptive session's plan keeps it free up to `tracking_room_cap`, so the rectifier sees the
    codecs the gradients depend on; a plan running none (retain / recompute only, planned to the
    byte) keeps nothing free."""
    used: set[tuple[str, str, str]] = set()
    for name, gp in policy.groups.items():
        for v in gp.variants:
            if v.count and v.checkpoint:
                used |= {(name, k, a.codec) for k, a in v.actions.items() if a.codec is not None}
    largest = 0
    for name, g in profile.groups.items():
        for op in g.ops:
            for c in op.codecs.values():
                if (name, op.key, c.codec) in used and not get_codec(c.codec, **c.params).lossless:
                    largest = max(largest, tracking_nbytes(op, c))
    return largest + OutlierTracker(profile).buffer_nbytes if largest else 0


@dataclass(frozen=True)
class CodecStats:
    """What tracking measured of one (group, op, codec), over `n` samples."""

    n: int
    per_element: float  # sum of the payload's bytes per element compressed
    rel_error: float  # the worst
    outliers: float  # sum of the outlier counts

    def merge(self, other: CodecStats) -> CodecStats:
        return CodecStats(
            self.n + other.n,
            self.per_element + other.per_element,
            max(self.rel_error, other.rel_error),
            self.outliers + other.outliers,
        )


class OutlierTracker:
    """Measures each profiled codec's encoded size and error on live activations of one step:
    the codecs the solver could choose for their op under some size and error
    (`schema.codec_can_pay`); a codec slower than recomputing its op is not measured,
    as nothing it measures could make it chosen.

    Sizes are host numbers; the worst error and the outlier count of each (op, codec) accumulate
    in place in one small device buffer (8 bytes per pair), so a tracking step holds no more
    memory however many blocks it measures and never waits for the device. The session passes
    what its budget leaves above the plan's peak (`room`, for the buffer) and above its block
    forwards (`forward_room`): an (op, codec) whose row or whose measurement (`tracking_nbytes`,
    beside the buffer) would not fit is not measured. At most `max_samples` per op and codec are
    measured (a custom loop that never calls ``session.step_done`` then stops paying for tracking
    once enough is measured)."""

    def __init__(
        self,
        profile: Profile,
        max_samples: int = 256,
        *,
        room: int | None = None,
        forward_room: int | None = None,
    ) -> None:
        self.max_samples = max_samples
        self.codecs: dict[tuple[str, str], list[Codec]] = {}
        self.masks: set[tuple[str, str]] = set()
        self.rows: dict[tuple[str, str, str], int] = {}
        granule = _GRANULE.get(profile.device.split(":")[0], 1)
        self.buffer_nbytes = 0  # the device buffer's bytes, its allocator's rounding included
        for g in profile.groups.values():
            for op in g.ops:
                useful: list[Codec] = []
                # a codec slower than recomputing its op is never chosen, whatever it measures;
                # a lossless one would measure what the profile has (its size is the shape's)
                for c in op.codecs.values():
                    codec = get_codec(c.codec, **c.params)
                    if not codec_can_pay(op, c) or codec.lossless:
                        continue
                    buffer = -(-(len(self.rows) + 1) * _ROW_NBYTES // granule) * granule
                    if room is not None and buffer > room:
                        continue  # its row would not fit beside the plan's peak
                    if forward_room is not None and tracking_nbytes(op, c) + buffer > forward_room:
                        continue  # measuring would not fit beside the plan's forward
                    self.rows[(g.name, op.key, c.codec)] = len(self.rows)
                    self.buffer_nbytes = buffer
                    useful.append(codec)
                if useful:
                    self.codecs[(g.name, op.key)] = useful
                    if op.mask:
                        self.masks.add((g.name, op.key))
        self._n = [0] * len(self.rows)
        self._per_element = [0.0] * len(self.rows)
        self._device_stats: torch.Tensor | None = None  # (rows, 2): worst error, outlier sum

    @property
    def stats(self) -> dict[tuple[str, str, str], CodecStats]:
        """Everything measured so far, per (group, op, codec); reading it waits for the device
        once."""
        if self._device_stats is None:
            return {}
        errs, outl = self._device_stats.T.tolist()
        return {
            k: CodecStats(self._n[i], self._per_element[i], errs[i], outl[i])
            for k, i in self.rows.items()
            if self._n[i]
        }

    def observe(self, group: str, key: str, out: Any, encoded: Any = None) -> None:
        """Measure the codecs of op `key` on its output `out` (reusing the runtime's `encoded`
        payload when it is the same codec's). Queues device work only: nothing is read here."""
        codecs = self.codecs.get((group, key))
        if not codecs:
            return
        x = cache_target((group, key) in self.masks, out)
        if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.dtype == torch.bool):
            return
        if self._device_stats is None:
            self._device_stats = torch.zeros(len(self.rows), 2, device=x.device)
        for codec in codecs:
            row = self.rows[(group, key, codec.name)]
            if self._n[row] >= self.max_samples or not codec.applicable(x):
                continue
            self._n[row] += 1
            enc = encoded if getattr(encoded, "codec", None) == codec.name else codec.encode(x)
            self._per_element[row] += enc.nbytes() / max(1, x.numel())
            worst = self._device_stats[row, 0]
            torch.maximum(worst, relative_error(x, codec.decode(enc)), out=worst)
            count = enc.meta.get("outlier_count")
            if count is not None:
                self._device_stats[row, 1] += count


def apply_stats(
    profile: Profile, stats: dict[tuple[str, str, str], CodecStats]
) -> tuple[Profile, list[str]]:
    """A copy of `profile` with every observed codec's mean payload (per element of what it
    compressed, so a profile of another shape takes it too) and worst error, and a list of
    human-readable changes (size change > 1 %, error change > 10 %)."""
    new = copy.deepcopy(profile)
    changes = []
    for (group, key, codec), st in stats.items():
        g = new.groups.get(group)
        op = next((o for o in g.ops if o.key == key), None) if g is not None else None
        if op is None or codec not in op.codecs:  # seen under another bucket's ops
            continue
        cp = op.codecs[codec]
        nbytes = round(st.per_element / st.n * op.numel)
        err, outl = st.rel_error, round(st.outliers / st.n)
        if abs(nbytes - cp.nbytes) > 0.01 * cp.nbytes or (
            abs(err - cp.rel_error) > 0.1 * max(cp.rel_error, 1e-6)
        ):
            changes.append(
                f"{group}:{key} {codec}: {cp.nbytes} -> {nbytes} B, error "
                f"{cp.rel_error:.3g} -> {err:.3g}, outliers {cp.n_outliers} -> {outl}"
            )
        if cp.grad_error is not None and cp.rel_error > 0:
            # what reaches the gradients scales with the codec's error on its input
            cp.grad_error *= err / cp.rel_error
        cp.nbytes, cp.rel_error, cp.n_outliers = nbytes, err, outl
    return new, changes


def should_switch(
    profile: Profile,
    current: Policy,
    new: Policy,
    static: StaticMemory,
    *,
    budget_nbytes: int,
    max_rel_error: float,
    accumulation: int = 1,
    max_grad_error: float | None = None,
) -> bool:
    """Switch from `current` to `new` when `current` no longer fits the budget, uses a codec whose
    measured error on `profile` is now above the limit, or is predicted to move a block's
    gradients more than `max_grad_error`, or when `new` is clearly (> 2 %) faster
    (both priced by their per-op sums, as the solver compares candidates: only `current`'s action
    tables may have been timed whole)."""
    if new.fingerprint() == current.fingerprint():
        return False
    cur = predict(profile, current, static, accumulation, measured_ms=False)
    if cur.peak_nbytes > budget_nbytes:
        return True
    if max_grad_error is not None and cur.grad_error > max_grad_error:
        return True
    errors = {
        (g.name, o.key, c.codec): c.rel_error
        for g in profile.groups.values()
        for o in g.ops
        for c in o.codecs.values()
    }
    for gname, gp in current.groups.items():
        for v in gp.variants:
            for key, a in v.actions.items():
                if (
                    a.codec is not None
                    and not errors.get((gname, key, a.codec), 0.0) <= max_rel_error
                ):
                    return True
    best = predict(profile, new, static, accumulation, measured_ms=False)
    return best.added_ms < 0.98 * cur.added_ms
