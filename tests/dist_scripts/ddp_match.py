"""DDP through Accelerate with Adacc, against the same global batch on one process.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 ... ddp_match.py --out D
    python ddp_match.py --out D --phases plain         # the single-process reference

Each step's global batch (4 rows) is split over the ranks; dropout is off, so the runs differ only
by summation order (and by codec error in the `compressed` phase). Phases: `plain` (no Adacc),
`lossless` (Adacc, a solved mixed policy without lossy codecs), `compressed` (Adacc, a fixed random
mix of retain / recompute / compress, so codecs run whatever the CPU's timings).
Each rank writes `{phase}_rank{r}.json`; rank 0 also saves `{phase}_params.pt`.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from accelerate import Accelerator
from common import global_rows, kinds, mean_over_ranks, mixed_budget, shard, write

import adacc_hf
from adacc_hf import assets
from adacc_hf.policy.builders import random_mix


def run(accel: Accelerator, phase: str, args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    r, n = accel.process_index, accel.num_processes
    # four blocks: the mixed budget mixes blocks with and without checkpointing (keeping ops in
    # tiny CPU blocks costs more dispatch overhead than it saves)
    model = assets.tiny_model("llama", seed=0, attention_dropout=0.0, num_hidden_layers=4)
    first = shard(global_rows(1, args.rows, args.seq_len, model.config), r, n)
    session = None
    if phase == "lossless":  # solved by rank 0 for a mixed budget, no lossy codec allowed
        ddp = {"ddp": True, "world_size": n} if n > 1 else {}  # DDP's buckets count
        budget = mixed_budget(model, first, args.fraction, **ddp)
        session = adacc_hf.prepare(model, budget, first, optimizer="adamw_torch", max_codec_error=0)
    elif phase == "compressed":  # a fixed mix with compression, whatever the CPU's timings
        policy = random_mix(
            adacc_hf.trace_model(model, first), seed=0, kinds=("retain", "recompute", "compress")
        )
        session = adacc_hf.prepare(model, policy=policy)
    opt = (torch.optim.SGD if args.optim == "sgd" else torch.optim.AdamW)(
        model.parameters(), lr=args.lr
    )
    ddp_model, opt = accel.prepare(model, opt)
    losses = []
    for step in range(1, args.steps + 1):
        batch = shard(global_rows(step, args.rows, args.seq_len, model.config), r, n)
        loss = ddp_model(**batch).loss
        accel.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss))
        if session is not None:
            session.step_done(step)
    report = {"phase": phase, "world_size": n, "losses": losses}
    if session is not None:
        report |= {
            "fingerprint": session.policy.fingerprint(),
            "kinds": kinds(session.policy),
            "summary": session.policy.summary(),
            "unknown_ops": sorted(session.handle.unknown_ops),
        }
        session.close()
    if accel.is_main_process:
        state = {
            k: v.detach().clone() for k, v in accel.unwrap_model(ddp_model).state_dict().items()
        }
        torch.save(state, f"{args.out}/{phase}_params.pt")
    report["seconds"] = time.perf_counter() - t0
    write(args.out, phase, report)
    accel.wait_for_everyone()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--phases", default="plain,lossless,compressed")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rows", type=int, default=4, help="global batch (rows per step)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--fraction", type=float, default=0.4)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    accel = Accelerator()
    for phase in args.phases.split(","):
        run(accel, phase, args)
    accel.end_training()


if __name__ == "__main__":
    main()
