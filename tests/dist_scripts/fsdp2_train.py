"""FSDP2 (`fully_shard`) with Adacc, under torchrun over gloo.

    torchrun --nproc_per_node 2 fsdp2_train.py --out D

Every block and the root are sharded over the ranks. Phases: `plain` (FSDP2 alone), `lossless`
(Adacc, a policy rank 0 solved for a mixed per-device budget with no lossy codec), `deferred` (the
same, profiled inside the first training forward as under the Trainer) and `compressed` (Adacc, a
fixed random mix of retain / recompute / compress). Each rank writes
`{phase}_rank{r}.json` (losses averaged over ranks, policy fingerprint, ops the runtime met that
the policy does not name); rank 0 saves the gathered parameters as `{phase}_params.pt`.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from common import global_rows, kinds, mean_over_ranks, mixed_budget, shard, write
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import adacc_hf
from adacc_hf import assets
from adacc_hf.policy.builders import random_mix


def run(phase: str, args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    r, n = dist.get_rank(), dist.get_world_size()
    # four blocks: the mixed budget mixes blocks with and without checkpointing (keeping ops in
    # tiny CPU blocks costs more dispatch overhead than it saves)
    model = assets.tiny_model("llama", seed=0, attention_dropout=0.0, num_hidden_layers=4)
    first = shard(global_rows(1, args.rows, args.seq_len, model.config), r, n)
    policy = None
    if phase == "compressed":
        policy = random_mix(
            adacc_hf.trace_model(model, first), seed=0, kinds=("retain", "recompute", "compress")
        )
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    # Measured on the sharded model (the root's gathered parameters count as held outside blocks).
    budget = mixed_budget(model, first, args.fraction, fsdp=True, world_size=n)
    session = None
    if phase == "lossless":  # every rank profiles (all-gathers inside), rank 0 solves
        session = adacc_hf.prepare(model, budget, first, optimizer="adamw_torch", max_codec_error=0)
    elif phase == "deferred":  # profiled inside the first training forward, as the Trainer does
        session = adacc_hf.prepare(model, budget, optimizer="adamw_torch", max_codec_error=0)
    elif phase == "compressed":
        session = adacc_hf.prepare(model, policy=policy)
    opt = (torch.optim.SGD if args.optim == "sgd" else torch.optim.AdamW)(
        model.parameters(), lr=args.lr
    )
    losses = []
    for step in range(1, args.steps + 1):
        batch = shard(global_rows(step, args.rows, args.seq_len, model.config), r, n)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
        if session is not None:
            session.step_done(step)
    report = {"phase": phase, "world_size": n, "losses": losses}
    if session is not None:
        cfg = session.config
        report |= {
            "fingerprint": session.policy.fingerprint(),
            "kinds": kinds(session.policy),
            "summary": session.policy.summary(),
            "unknown_ops": sorted(session.handle.unknown_ops),
            "sharding": {"fsdp": cfg.run.fsdp, "world_size": cfg.run.world_size},
            "sharded_params": all(isinstance(p, DTensor) for p in model.parameters()),
        }
        session.close()
    full = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    if r == 0:
        torch.save(full, f"{args.out}/{phase}_params.pt")
    report["seconds"] = time.perf_counter() - t0
    write(args.out, phase, report)
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--phases", default="plain,lossless,deferred,compressed")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rows", type=int, default=4, help="global batch (rows per step)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--fraction", type=float, default=0.4)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dist.init_process_group("gloo")
    try:
        for phase in args.phases.split(","):
            run(phase, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
