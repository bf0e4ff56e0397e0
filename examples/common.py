"""What the examples share: timing a training step under several policies, interleaved."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from adacc_hf import Policy, apply_adacc


def step_ms(
    model: torch.nn.Module,
    batches: Sequence[Mapping[str, Any]],
    policies: list[Policy],
    opt: torch.optim.Optimizer,
    amp: torch.dtype | None,
    repeats: int,
) -> list[float]:
    """Median time of one training step (forward + backward of each micro-batch, no optimizer)
    under each policy, the policies interleaved round by round (the first round warms up), each
    round starting with the next policy, so none always follows the same one."""
    times: list[list[float]] = [[] for _ in policies]
    for i in range(repeats + 1):
        for j in range(len(policies)):
            k = (i + j) % len(policies)
            with apply_adacc(model, policies[k]):
                t0 = time.perf_counter()
                for b in batches:
                    with torch.autocast(
                        "cpu", dtype=amp or torch.bfloat16, enabled=amp is not None
                    ):
                        loss = model(**b).loss / len(batches)
                    loss.backward()
                if i:
                    times[k].append((time.perf_counter() - t0) * 1e3)
            opt.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]
