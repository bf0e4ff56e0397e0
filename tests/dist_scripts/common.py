"""Shared by the scripts `tests/integrations/test_distributed.py` launches: tiny models, budgets, reports."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from adacc_hf import Policy, assets, estimate_static_memory, profile_model
from adacc_hf.solver import budget_between


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def mixed_budget(model, batch, fraction: float = 0.4, **static: Any) -> int:
    """A per-device budget between full recomputation's need and no checkpointing's."""
    est = estimate_static_memory(model, optimizer=static.pop("optimizer", "adamw_torch"), **static)
    return budget_between(profile_model(model, batch, repeats=1), est, fraction)


def kinds(policy: Policy) -> list[str]:
    """The action kinds a policy uses (plus 'no_checkpoint' for blocks run without one)."""
    out = {
        str(a).split(":")[0]
        for g in policy.groups.values()
        for v in g.variants
        for a in v.actions.values()
    }
    out |= {"no_checkpoint" for g in policy.groups.values() for v in g.variants if not v.checkpoint}
    return sorted(out)


def global_rows(step: int, rows: int, seq_len: int, config) -> dict[str, torch.Tensor]:
    """The global batch of optimizer step `step` (identical on every rank)."""
    return assets.tiny_batch("llama", config, batch_size=rows, seq_len=seq_len, seed=1000 + step)


def shard(batch: dict[str, torch.Tensor], r: int, n: int) -> dict[str, torch.Tensor]:
    """Rank `r`'s contiguous slice of the rows of `batch`."""
    size = len(batch["input_ids"]) // n
    return {k: v[r * size : (r + 1) * size] for k, v in batch.items()}


def mean_over_ranks(x: torch.Tensor) -> float:
    x = x.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return float(x)


def write(out_dir: str, name: str, data: dict[str, Any]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}_rank{rank()}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
