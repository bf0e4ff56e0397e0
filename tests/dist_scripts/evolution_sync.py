"""Policy switches happen on every rank at the same step (DDP through Accelerate, custom loop).

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 ... evolution_sync.py --out D

Each rank trains on its own rows. After step `--shift-at`, outlier channels appear in rank 0's
projection weights only, so only rank 0's activations make naive INT4 too lossy and only rank 0's
statistics call for a switch. Codec times and the runtime's dispatch overhead in the profile are
zeroed so the first policy compresses whatever the CPU's timings; every rank's session plans the
batch's bucket from rank 0's profile (`profiles=`). The budget bounds the whole step's peak, so
the batch is long enough (2 x 128 tokens) for activations, not gradients or the optimizer step, to
set it: a budget 40 % of the way from full recomputation's peak to no checkpointing's then needs
memory saved in the blocks. Phases: `synced` (the default wiring: samples merged over ranks, rank 0
decides and broadcasts) and `unsynced` (each rank decides alone after the shared first policy: the
control that shows the ranks would otherwise disagree). Each rank writes
`{phase}_rank{r}.json` with every switch as (step, fingerprint) and the tracking steps.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
from accelerate import Accelerator
from common import kinds, write

from adacc_hf import assets, estimate_static_memory, profile_model
from adacc_hf.engine.coordinator import Coordinator
from adacc_hf.engine.facts import RunFacts
from adacc_hf.engine.session import AdaccConfig, AdaccSession
from adacc_hf.engine.shapes import shape_key
from adacc_hf.schema import Profile
from adacc_hf.solver import budget_between

CODEC = "int4_naive"
SEQ_LEN = 128  # a bucket edge: the session plans this very shape
# Rank 0's profile, on every rank and in both phases: a rank deciding alone re-solves it with its
# own codec statistics only, not with its own timings (which alone could make it switch).
_profiles: list[Profile] = []


def run(accel: Accelerator, phase: str, args: argparse.Namespace) -> None:
    r = accel.process_index
    model = assets.tiny_model(
        "llama",
        seed=0,
        hidden_size=128,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.0,
    )
    batch = assets.tiny_batch("llama", model, batch_size=2, seq_len=SEQ_LEN, seed=100 + r)
    if not _profiles:
        profile = None
        if r == 0:
            profile = profile_model(model, batch, codecs=[CODEC], repeats=1)
            for g in profile.groups.values():
                g.dispatch_ms = 0.0  # keeping ops must pay whatever the CPU's timings (see above)
                for op in g.ops:
                    for c in op.codecs.values():
                        c.encode_ms = c.decode_ms = 0.0
        shared = [profile]
        torch.distributed.broadcast_object_list(shared, src=0)
        _profiles.append(shared[0])
    profile = copy.deepcopy(_profiles[0])
    static = estimate_static_memory(model, optimizer="sgd")
    budget = budget_between(profile, static, 0.4)
    cfg = AdaccConfig(
        budget=budget,
        codecs=[CODEC],
        adaptive=True,
        max_codec_error=0.3,
        run=RunFacts(optimizer="sgd"),
    )
    key = shape_key(batch, encoder_decoder=False)
    assert key[1] == SEQ_LEN, key  # else the session would profile a padded batch itself
    # coordinated across the ranks; plans the batch's bucket from this profile
    session = AdaccSession(model, cfg, profiles={key: profile})
    session.setup(batch)  # every rank runs rank 0's first policy
    first = session.policy
    if phase == "unsynced":
        session.coordinator = Coordinator()  # each rank decides alone
    session.on_step_begin(1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ddp_model, opt = accel.prepare(model, opt)
    switches, losses = [], []
    for step in range(1, args.steps + 1):
        loss = ddp_model(**batch).loss
        accel.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
        if step == args.shift_at and r == 0:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("proj.weight"):
                        p[:2] *= 15.0
        event = session.step_done(step)
        if event is not None and event.kind == "switch":
            switches.append([step, event.policy.fingerprint()])
    write(
        args.out,
        phase,
        {
            "phase": phase,
            "first_fingerprint": first.fingerprint(),
            "first_kinds": kinds(first),
            "switches": switches,
            "tracking_steps": session.schedule.history,
            "final_fingerprint": session.policy.fingerprint(),
            "losses": losses,
        },
    )
    session.close()
    accel.wait_for_everyone()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--phases", default="synced,unsynced")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--shift-at", type=int, default=5)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    accel = Accelerator()
    for phase in args.phases.split(","):
        run(accel, phase, args)
    accel.end_training()


if __name__ == "__main__":
    main()
