"""Training steps, and how long they take when strategies are timed side by side.

A step is forward + backward (+ gradient clipping) + optimizer step, then the strategy's
`after_step` (Adacc's evolution). `time_interleaved` times several strategies round-robin on the
same model and batch, so noise from other jobs on the machine falls on all of them alike; each
step is timed with `adacc_hf.runtime.timing.time_call` (synchronised on CUDA).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from adacc_hf.runtime.timing import time_call

from .prepared import Prepared


def optimizer_with_states(model: nn.Module, *, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW (learning rate 0) whose states exist, as in a running fine-tune: one step on zero
    gradients, which leaves the weights as they are."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, **({"fused": True} if fused else {}))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def loss_of(out: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, Mapping) else out[0]


def train_step(
    model: nn.Module,
    batch: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None,
    strategy: Prepared | None = None,
    *,
    clip: float | None = None,
) -> float:
    """Forward, backward and optimizer step; returns the loss."""
    loss = loss_of(model(**batch))
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if strategy is not None:
        strategy.after_step()
    return float(loss.detach())


def timed_step(
    model: nn.Module,
    batch: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None,
    strategy: Prepared | None = None,
    **kwargs: Any,
) -> tuple[float, float]:
    """(loss, seconds) of one `train_step`."""
    loss: list[float] = []
    device = next(model.parameters()).device
    ms = time_call(
        lambda: loss.append(train_step(model, batch, optimizer, strategy, **kwargs)), device, 1
    )
    return loss[0], ms / 1e3


def time_interleaved(
    strategies: Mapping[str, Prepared],
    model: nn.Module,
    batch: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    *,
    rounds: int = 3,
    steps: int = 2,
    warmup: int = 1,
    errors: tuple[type[BaseException], ...] = (),
    on_error: Callable[[str, BaseException], None] | None = None,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per training step of each strategy, measured round-robin.

    Each round enters every strategy in turn (in a seeded random order of its own), runs
    `warmup` untimed steps, then `steps` timed ones. Returns every timed step per strategy. A
    strategy whose step raises one of `errors` (out of memory) is dropped from later rounds.
    `cpu`, when given, gets each timed step's process CPU seconds per strategy (on a shared CPU,
    what one thread's work cost whatever the other jobs did).
    """
    names = list(strategies)
    times: dict[str, list[float]] = {n: [] for n in names}
    failed: set[str] = set()
    order = random.Random(0)
    for _ in range(rounds):
        # A fresh order each round: a strategy neither always runs first nor always follows the
        # same one (what it leaves in the allocator and caches shifts the next one's time).
        for n in order.sample(names, len(names)):
            s = strategies[n]
            if not s.fits_budget or n in failed:
                continue
            try:
                with s:
                    for i in range(warmup + steps):
                        c0 = time.process_time()
                        _, took = timed_step(model, batch, optimizer, s)
                        if i >= warmup:
                            times[n].append(took)
                            if cpu is not None:
                                cpu.setdefault(n, []).append(time.process_time() - c0)
            except errors as e:
                failed.add(n)
                times[n] = []
                if cpu is not None:
                    cpu.pop(n, None)
                optimizer.zero_grad(set_to_none=True)
                if on_error is not None:
                    on_error(n, e)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def step_stats(seconds: list[float], tokens: int) -> dict[str, Any]:
    """Step times (ms: median, min, mean, all) and tokens/s (median step, fastest step)."""
    nan = float("nan")
    if not seconds:
        return dict.fromkeys(("step_ms_median", "step_ms_min", "step_ms_mean"), nan) | {
            "step_ms_all": [],
            "tokens_per_s": nan,
            "tokens_per_s_best": nan,
        }
    med = median(seconds)
    return {
        "step_ms_median": med * 1e3,
        "step_ms_min": min(seconds) * 1e3,
        "step_ms_mean": sum(seconds) / len(seconds) * 1e3,
        "step_ms_all": [t * 1e3 for t in seconds],
        "tokens_per_s": tokens / med,
        "tokens_per_s_best": tokens / min(seconds),
    }
