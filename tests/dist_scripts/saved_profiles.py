"""Saved profiles under two ranks: a rank that finds none (a node without the shared directory)
makes every rank profile, with no collective left waiting; where every rank finds them, every
rank plans from them.

torchrun --standalone --nproc_per_node 2 saved_profiles.py --out D
"""

from __future__ import annotations

import argparse
import os

import torch.distributed as dist
from common import mixed_budget, rank, write

import adacc_hf
from adacc_hf import assets
from adacc_hf.integrations import write_artifacts


def planned(budget: int, source: str | None, out_dir: str) -> dict:
    """`prepare` on a fresh tiny LLaMA; whether it profiled (the memory timeline ran)."""
    model = assets.tiny_model("llama", seed=0)
    batch = assets.tiny_batch("llama", model)
    session = adacc_hf.prepare(model, budget, batch, profile_from=source, codecs=[])
    phases = session.policy.metadata["planning_ms"]
    out = {"profiled": "memory" in phases, "policy": session.policy.fingerprint()}
    if source is None and rank() == 0:
        write_artifacts(os.path.join(out_dir, "saved"), session)
    session.close()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    model = assets.tiny_model("llama", seed=0)
    budget = mixed_budget(model, assets.tiny_batch("llama", model))
    saved = os.path.join(args.out, "saved")
    report = {"first": planned(budget, None, args.out)}
    dist.barrier()
    report["rank0_only"] = planned(budget, saved if rank() == 0 else None, args.out)
    report["every_rank"] = planned(budget, saved, args.out)
    write(args.out, "saved", report)
    dist.destroy_process_group()
