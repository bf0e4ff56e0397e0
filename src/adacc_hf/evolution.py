"""The rectifier: re-measure codec ratios and errors during training, re-solve when they drift.

Outlier statistics move early in training and settle later, so tracking follows an exponential
backoff: tracking steps 1, 2, 4, 8, ... apart, up to `max_interval` (reset to 1 when the policy
changes). On a tracking step the runtime hands every op that has a profiled codec the solver could
choose to an `OutlierTracker` during that step's normal forward (no extra forward): the codec's
encoded size and error are measured on the live activation of every checkpointed block. The errors and outlier
counts stay on the device until the step is over and are read in one transfer (the training step
itself never waits for the device). `apply` folds the means into a copy of the `Profile`, which
the solver turns into the next policy.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from .codecs import Codec, get_codec, relative_error
from .policy import Policy
from .runtime.ops import cache_target
from .schema import Profile
from .solver import StaticMemory, predict
from .solver.cost_model import codec_can_pay


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


@dataclass
class _Sample:
    nbytes: int
    rel_error: float
    n_outliers: int
    numel: int  # of the tensor the codec compressed (sizes scale to other shapes per element)


class OutlierTracker:
    """Collects each profiled codec's encoded size and error on live activations of one forward:
    the codecs the solver could choose for their op under some size and error
    (`solver.cost_model.codec_can_pay`); a codec slower than recomputing its op is not measured,
    as nothing it measures could make it chosen.

    At most `max_samples` per op and codec are kept (a custom loop that never calls
    ``session.step_done`` then stops paying for tracking once enough is measured)."""

    def __init__(self, profile: Profile, max_samples: int = 256) -> None:
        self.max_samples = max_samples
        self.codecs: dict[tuple[str, str], list[Codec]] = {}
        self.masks: set[tuple[str, str]] = set()
        for g in profile.groups.values():
            for op in g.ops:
                # a codec slower than recomputing its op is never chosen, whatever it measures
                useful = [c for c in op.codecs.values() if codec_can_pay(op, c)]
                if useful:
                    self.codecs[(g.name, op.key)] = [get_codec(c.codec, **c.params) for c in useful]
                    if op.mask:
                        self.masks.add((g.name, op.key))
        self._samples: dict[tuple[str, str, str], list[_Sample]] = defaultdict(list)
        self._counts: dict[tuple[str, str, str], int] = defaultdict(int)
        # (key, encoded bytes, error, outlier count): device scalars, read in one transfer
        self._pending: list[tuple[tuple[str, str, str], int, torch.Tensor, torch.Tensor, int]] = []

    @property
    def samples(self) -> dict[tuple[str, str, str], list[_Sample]]:
        """Every measurement so far, per (group, op, codec); reading it waits for the device once
        (the first read after a tracking step)."""
        if self._pending:
            errs = torch.stack([p[2] for p in self._pending]).tolist()
            outl = torch.stack([p[3] for p in self._pending]).tolist()
            for (key, nbytes, _, _, numel), err, n in zip(self._pending, errs, outl, strict=True):
                self._samples[key].append(_Sample(nbytes, float(err), int(n), numel))
            self._pending.clear()
        return self._samples

    def observe(self, group: str, key: str, out: Any, encoded: Any = None) -> None:
        """Measure the codecs of op `key` on its output `out` (reusing the runtime's `encoded`
        payload when it is the same codec's). Queues device work only: nothing is read here."""
        codecs = self.codecs.get((group, key))
        if not codecs:
            return
        x = cache_target((group, key) in self.masks, out)
        if not isinstance(x, torch.Tensor) or not (x.is_floating_point() or x.dtype == torch.bool):
            return
        for codec in codecs:
            k3 = (group, key, codec.name)
            if self._counts[k3] >= self.max_samples or not codec.applicable(x):
                continue
            self._counts[k3] += 1
            enc = encoded if getattr(encoded, "codec", None) == codec.name else codec.encode(x)
            err = relative_error(x, codec.decode(enc))
            count = enc.meta.get("outlier_count")
            if count is None:
                count = torch.zeros((), dtype=torch.int32, device=x.device)
            self._pending.append((k3, enc.nbytes(), err, count, x.numel()))

    def apply(self, profile: Profile) -> tuple[Profile, list[str]]:
        """A copy of `profile` with every observed codec's mean payload (per element of what it
        compressed, so a profile of another shape takes it too) and worst error, and a list of
        human-readable changes (size change > 1 %, error change > 10 %)."""
        new = copy.deepcopy(profile)
        changes = []
        for (group, key, codec), samples in self.samples.items():
            g = new.groups.get(group)
            op = next((o for o in g.ops if o.key == key), None) if g is not None else None
            if op is None or codec not in op.codecs:  # seen under another bucket's ops
                continue
            cp = op.codecs[codec]
            per_element = sum(s.nbytes / max(1, s.numel) for s in samples) / len(samples)
            nbytes = round(per_element * op.numel)
            err = max(s.rel_error for s in samples)
            outl = round(sum(s.n_outliers for s in samples) / len(samples))
            if abs(nbytes - cp.nbytes) > 0.01 * cp.nbytes or (
                abs(err - cp.rel_error) > 0.1 * max(cp.rel_error, 1e-6)
            ):
                changes.append(
                    f"{group}:{key} {codec}: {cp.nbytes} -> {nbytes} B, error "
                    f"{cp.rel_error:.3g} -> {err:.3g}, outliers {cp.n_outliers} -> {outl}"
                )
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
) -> bool:
    """Switch from `current` to `new` when `current` no longer fits the budget or uses a codec whose
    measured error on `profile` is now above the limit, or when `new` is clearly (> 2 %) faster
    (both priced by their per-op sums, as the solver compares candidates: only `current`'s action
    tables may have been timed whole)."""
    if new.fingerprint() == current.fingerprint():
        return False
    cur = predict(profile, current, static, accumulation, measured_ms=False)
    if cur.peak_nbytes > budget_nbytes:
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
                    a.kind == "compress"
                    and not errors.get((gname, key, a.codec), 0.0) <= max_rel_error
                ):
                    return True
    best = predict(profile, new, static, accumulation, measured_ms=False)
    return best.added_ms < 0.98 * cur.added_ms
