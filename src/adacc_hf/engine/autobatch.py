"""Automatic micro-batch: the micro-batch and policy with the best predicted tokens/s under the
budget, at the run's global batch (micro-batch x gradient accumulation).

Candidates are the divisors of the global batch (so accumulation keeps it exactly), smallest
first. Each is planned as training plans it (`AdaccSession.plan`, at its own accumulation): the
first is profiled in full, the others scale its op costs by their size and measure their memory
(the step timeline, the action tables the policy uses), so a candidate's predicted step peak is
as exact as a training plan's. The first candidate no policy fits, or whose planning runs out of
the device's memory (``torch.OutOfMemoryError``: the budget is above what the device holds), ends
the search (larger ones hold more).

Time: a step under full recomputation is timed at the smallest and the largest fitting candidate
(what a micro-batch costs beyond its share of the work: per-call overheads, small kernels), fitted
as ``a + b * micro_batch``; a candidate's step is that less the share of it the policy saves over
full recomputation (recompute time, as the cost model predicts it, over the blocks' forward and
backward). Predicted tokens/s = ``micro_batch * length / step`` (the bucket's length: with
``max_seq_len`` set, the run's longest batch is planned, as training plans it).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import AdaccError, BudgetError
from ..policy import Policy
from ..runtime import apply_adacc
from ..runtime.context import autocast_context
from ..runtime.peak import forward_loss
from ..schema import Profile
from ..solver import least_memory_policy
from ..units import fmt_bytes
from .config import AdaccConfig
from .facts import detect_autocast
from .oom import first_line, release
from .plans import AdaccEvent
from .session import AdaccSession
from .shapes import ShapeKey, row_tokens, rows

logger = logging.getLogger("adacc_hf")

__all__ = ["BatchChoice", "Candidate", "choose_micro_batch", "rows"]


@dataclass
class Candidate:
    """One micro-batch the search planned: its policy's predicted peak and tokens/s (None where
    no policy fits)."""

    micro_batch: int
    accumulation: int
    peak_nbytes: int | None = None
    step_ms: float | None = None
    tokens_per_s: float | None = None
    note: str = ""


@dataclass
class BatchChoice:
    """The chosen micro-batch, its accumulation, policy and profile, and every candidate."""

    micro_batch: int
    accumulation: int
    global_batch: int
    tokens_per_s: float
    policy: Policy
    profile: Profile
    key: ShapeKey
    candidates: list[Candidate] = field(default_factory=list)
    profiles: dict[ShapeKey, Profile] = field(default_factory=dict)

    def message(self) -> str:
        """One line per candidate, the chosen one marked."""
        lines = [
            f"micro-batch {self.micro_batch} x accumulation {self.accumulation} (global batch "
            f"{self.global_batch}): predicted {self.tokens_per_s:,.0f} tokens/s"
        ]
        for c in self.candidates:
            mark = "*" if c.micro_batch == self.micro_batch else " "
            if c.peak_nbytes is None:
                lines.append(f" {mark} {c.micro_batch:>4} x {c.accumulation:<4} {c.note}")
            else:
                lines.append(
                    f" {mark} {c.micro_batch:>4} x {c.accumulation:<4} peak "
                    f"{fmt_bytes(c.peak_nbytes)}, {c.step_ms:.1f} ms a micro-batch, "
                    f"{c.tokens_per_s:,.0f} tokens/s"
                )
        return "\n".join(lines)

    def metrics(self) -> dict[str, float]:
        """Numbers for the Trainer log."""
        peak = self.policy.metadata.get("predicted", {}).get("peak_nbytes", 0)
        return {
            "adacc/micro_batch": float(self.micro_batch),
            "adacc/accumulation": float(self.accumulation),
            "adacc/predicted_tokens_per_s": float(self.tokens_per_s),
            "adacc/predicted_peak_mib": float(peak) / 2**20,
        }

    def event(self, step: int = 0) -> AdaccEvent:
        return AdaccEvent(step, "batch", self.policy, self.message(), self.metrics())


def _time_step_ms(
    model: nn.Module, batch: Mapping[str, Any], policy: Policy, autocast: torch.dtype | None
) -> float:
    """Median wall time of a forward + backward under `policy` (after one warm-up); the model's
    gradients are left as they were."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    device = next(model.parameters()).device
    times = []
    handle = apply_adacc(model, policy)
    try:
        for _ in range(3):
            for p in params:
                p.grad = None
            t0 = time.perf_counter()
            with autocast_context(device, autocast):
                loss = forward_loss(model, batch)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
            del loss
    finally:
        handle.remove()
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    return statistics.median(times[1:])


def _time_ends(
    model: nn.Module, planned: list, autocast: torch.dtype | None, device: torch.device
) -> list[tuple[int, float, Policy]]:
    """Full recomputation's measured step time at the smallest and the largest fitting
    candidates; a largest one that runs out of memory is dropped from `planned` (with its note)
    and the next largest timed instead."""
    while True:
        ends = [planned[0]] if len(planned) == 1 else [planned[0], planned[-1]]
        oom = None
        try:
            return [
                (c.micro_batch, _time_step_ms(model, b, least, autocast), least)
                for c, _, _, _, b, least in ends
            ]
        except torch.OutOfMemoryError as e:
            oom = str(e)
        release(device)
        if len(planned) == 1:
            raise torch.OutOfMemoryError(
                f"{oom}\nadacc auto micro-batch: even a micro-batch of "
                f"{planned[0][0].micro_batch} under full recomputation does not fit the device"
            )
        dropped = planned.pop()[0]
        dropped.peak_nbytes = dropped.step_ms = dropped.tokens_per_s = None
        dropped.note = f"out of memory when timed: {first_line(oom)}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def choose_micro_batch(
    model: nn.Module,
    sample_batch: Mapping[str, Any],
    config: AdaccConfig,
    global_batch: int,
    *,
    max_micro_batch: int | None = None,
    profiles: dict[ShapeKey, Profile] | None = None,
) -> BatchChoice:
    """The micro-batch (a divisor of `global_batch`, at most `max_micro_batch`) and policy with
    the best predicted tokens/s whose step fits `config.budget` (see the module docstring).
    `sample_batch` gives the rows (repeated as needed) and the length planned for; raises
    `BudgetError` when not even a micro-batch of 1 fits. `profiles` (by bucket) are reused and
    filled: another budget's choice for the same model and batch profiles nothing anew."""
    if global_batch < 1:
        raise AdaccError(f"auto micro-batch: the global batch must be >= 1, got {global_batch}")
    model.train()
    device = next(model.parameters()).device
    autocast = config.run.autocast or detect_autocast(device)
    profiles = profiles if profiles is not None else {}
    static = None
    planned: list[tuple[Candidate, Policy, Profile, ShapeKey, dict[str, Any], Policy]] = []
    cands: list[Candidate] = []
    for mb in divisors(global_batch):
        if max_micro_batch is not None and mb > max_micro_batch:
            break
        acc = global_batch // mb
        cand = Candidate(mb, acc)
        cands.append(cand)
        cfg = config.with_run(gradient_accumulation_steps=acc).replace(adaptive=False)
        session = AdaccSession(model, cfg, profiles=profiles)
        session.autocast = autocast
        session.static = static
        planner, batch = session.planner, rows(sample_batch, mb)
        # the run's longest batch, as `AdaccSession.setup` plans it
        key = planner.longest_key(batch) or planner.key_of(batch)
        batch = session.ctx.padded(batch, key)
        oom = None
        try:
            plan = planner.plan(batch, key)
        except BudgetError as e:
            cand.note = f"no policy fits: {str(e).split(':')[0]}"
            break
        except torch.OutOfMemoryError as e:
            oom = str(e)  # leaving this block frees what the failed profile held
        finally:
            session.close()
        if oom is not None:
            cand.note = f"out of memory while planning: {first_line(oom)}"
            release(device)
            break
        static = session.static
        pred = plan.policy.metadata.get("predicted", {})
        cand.peak_nbytes = int(pred["peak_nbytes"])
        assert plan.profile is not None and plan.key is not None
        assert session.static is not None  # set by the plan
        least = least_memory_policy(plan.profile, session.static, acc)
        planned.append((cand, plan.policy, plan.profile, plan.key, batch, least))
    if not planned:
        raise BudgetError(
            f"auto micro-batch: not even a micro-batch of 1 fits the budget ({cands[0].note})"
        )
    measured = _time_ends(model, planned, autocast, device)
    if len(measured) == 1:
        a, slope = 0.0, measured[0][1] / measured[0][0]
    else:
        (m1, t1, _), (m2, t2, _) = measured
        slope = max(0.0, (t2 - t1) / (m2 - m1))
        a = max(0.0, t1 - slope * m1)
    for cand, policy, profile, key, _, least in planned:
        full_ms = a + slope * cand.micro_batch
        added = float(policy.metadata["predicted"]["added_ms"])
        least_added = float(least.metadata["predicted"]["added_ms"])
        # The share of full recomputation's step the policy saves, in the profile's own units
        # (per-op timings run slower than the step they sum to), applied to the measured step.
        blocks_ms = 3 * sum(g.block_fwd_ms * g.num_blocks for g in profile.groups.values())
        saved = (least_added - added) / max(1e-9, blocks_ms + least_added)
        cand.step_ms = full_ms * (1 - min(max(saved, 0.0), 0.9))
        cand.tokens_per_s = cand.micro_batch * row_tokens(key) / cand.step_ms * 1e3
    best = max(planned, key=lambda p: p[0].tokens_per_s or 0.0)
    cand, policy, profile, key, _, _ = best
    choice = BatchChoice(
        micro_batch=cand.micro_batch,
        accumulation=cand.accumulation,
        global_batch=global_batch,
        tokens_per_s=float(cand.tokens_per_s or 0.0),
        policy=policy,
        profile=profile,
        key=key,
        candidates=cands,
        profiles=profiles,
    )
    logger.info("adacc auto micro-batch: %s", choice.message())
    return choice
