"""Accuracy runs: the same training run under each strategy, compared by held-out loss.

`train_run` trains a fresh model (`tasks.Task.make`) under one strategy with AdamW and gradient
clipping 1.0, evaluating on the held-out blocks every few steps. `compressing_budget` picks the
Adacc budget: the one, among fractions 0.05 ... 0.95 of the way from the smallest feasible budget
to no checkpointing's need, at which Adacc's policy compresses the most bytes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from adacc_hf import Policy

from .adacc import Profiles, budget_range, solved_session
from .steps import loss_of, median, timed_step
from .strategies import label, prepare
from .tasks import Task, batch_of


@torch.no_grad()
def eval_loss(model: torch.nn.Module, ev: torch.Tensor, bs: int, device: torch.device) -> float:
    """Mean loss over the held-out blocks (eval mode, no dropout)."""
    was = model.training
    model.eval()
    total, n = 0.0, 0
    for i in range(0, len(ev), bs):
        chunk = ev[i : i + bs]
        total += float(loss_of(model(**batch_of(chunk, device)))) * len(chunk)
        n += len(chunk)
    model.train(was)
    return total / n


def compressed_nbytes(policy: Policy) -> int:
    """Raw bytes of the op outputs the policy compresses, summed over blocks."""
    total = 0
    for g in policy.groups.values():
        for v in g.variants:
            if not v.checkpoint:
                continue
            for op in g.ops:
                if v.action(op.key).kind == "compress":
                    total += op.nbytes * v.count
    return total


def compressing_budget(
    model: torch.nn.Module, profile, static: int
) -> tuple[int, float, list[dict[str, Any]]]:
    """(budget, its fraction, the scan): where Adacc's policy compresses the most bytes."""
    lo, hi = budget_range(profile, static)
    scan = []
    best = (lo + (hi - lo) // 2, 0.5, -1)
    for i in range(1, 20):
        f = i / 20
        budget = int(lo + f * (hi - lo))
        policy = solved_session(model, profile, budget, static).policy
        c = compressed_nbytes(policy)
        scan.append({"fraction": f, "budget_nbytes": budget, "compressed_nbytes": c})
        if c > best[2]:
            best = (budget, f, c)
    return best[0], best[1], scan


def train_run(
    name: str,
    task: Task,
    *,
    steps: int,
    bs: int,
    lr: float,
    eval_every: int,
    eval_bs: int,
    device: torch.device,
    budget: int | None,
    static: int,
    profiles: Profiles | None,
    seed: int,
    eval0: float | None,
) -> dict[str, Any]:
    """One training run of `task` under strategy `name`: losses, evaluations, step time."""
    model = task.make()
    tr, ev = task.train, task.held_out
    strategy = prepare(
        name,
        model,
        batch_of(tr[:bs], device),
        budget_nbytes=budget,
        static_nbytes=static,
        profiles=profiles,
    ).prepare()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    torch.manual_seed(seed)
    losses, times = [], []
    evals = [(0, eval0 if eval0 is not None else eval_loss(model, ev, eval_bs, device))]
    t_run = time.perf_counter()
    with strategy:
        for step in range(1, steps + 1):
            batch = batch_of(tr[(step - 1) * bs : step * bs], device)
            loss, took = timed_step(model, batch, opt, strategy, clip=1.0)
            losses.append(loss)
            times.append(took)
            if step % eval_every == 0 or step == steps:
                evals.append((step, eval_loss(model, ev, eval_bs, device)))
                print(
                    f"  [{name}] step {step}: train {loss:.4f}, eval {evals[-1][1]:.4f} "
                    f"({median(times):.2f} s/step)",
                    flush=True,
                )
    out = {
        "label": label(name),
        "train_loss": losses,
        "eval_loss": evals,
        "final_eval_loss": evals[-1][1],
        "step_s_median": median(times),
        "wall_s": time.perf_counter() - t_run,
        "finite": all(math.isfinite(x) for x in losses),
    }
    if strategy.policy is not None:
        out["policy_summary"] = strategy.policy.summary()
        out["compressed_nbytes"] = compressed_nbytes(strategy.policy)
        out["fallbacks"] = sorted(getattr(strategy, "fallbacks", ()))
    if name != "none":
        out["info"] = {k: v for k, v in strategy.info.items() if k != "predicted"}
    del model, opt
    return out
