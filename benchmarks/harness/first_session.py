"""The first GPU check's ``session`` section: a user's custom loop under `adacc_hf.prepare`.

SmolLM2-135M (bf16) trains a few steps on batches of several lengths under a tight budget, as a
user's loop would: the session plans each bucket, turns on expandable segments and runs its
reserved-memory guard after every step. Per step: the allocated peak (the allocator's statistics,
reset per step here: the benchmark owns the process) and the reserved bytes after the step
against the budget, and the session's events (plans, guard re-plans).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from adacc_hf import estimate_static_memory, prepare, profile_model
from adacc_hf.runtime.allocator import reserved_nbytes
from adacc_hf.solver import budget_between

from .memory import free_cached
from .models import ModelSpec
from .report import MiB


def session_run(
    spec: ModelSpec, batch_size: int, lengths: list[int], fraction: float, device, dtype
) -> dict[str, Any]:
    model, weights = spec.build(device, dtype)
    cuda = device.type == "cuda"
    optimizer = "adamw_torch_fused" if cuda else "adamw_torch"
    static = estimate_static_memory(model, optimizer=optimizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if cuda else {}))
    longest = max(lengths)
    batches = [_batch(model, spec, batch_size, n, seed=i) for i, n in enumerate(lengths)]
    sample = batches[lengths.index(longest)]
    budget = budget_between(profile_model(model, sample, repeats=1), static, fraction)
    free_cached()
    t0 = time.perf_counter()
    session = prepare(model, budget, sample, optimizer=optimizer, adaptive=True)
    res: dict[str, Any] = {
        "model": spec.name,
        "weights": weights,
        "dtype": str(dtype),
        "batch": batch_size,
        "lengths": lengths,
        "budget_nbytes": budget,
        "budget_fraction": fraction,
        "setup_s": time.perf_counter() - t0,
        "steps": [],
    }
    for step, batch in enumerate(batches, start=1):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t1 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        reserved = reserved_nbytes(device)
        allocated = torch.cuda.max_memory_allocated(device) if cuda else None
        event = session.step_done(step)
        row = {
            "seq_len": int(batch["input_ids"].shape[1]),
            "loss": float(loss.detach()),
            "seconds": time.perf_counter() - t1,
            "allocated_peak_nbytes": allocated,
            "reserved_nbytes": reserved,
            "over_budget": None if reserved is None else reserved > budget,
            "predicted_peak_nbytes": session.policy.metadata.get("predicted", {}).get(
                "peak_nbytes"
            ),
            "event": event.kind if event is not None else None,
        }
        res["steps"].append(row)
        print(
            f"[{spec.name} session] step {step} len {row['seq_len']}: allocated "
            f"{(allocated or 0) / MiB:.1f} reserved {(reserved or 0) / MiB:.1f} budget "
            f"{budget / MiB:.1f} MiB",
            flush=True,
        )
    res["events"] = [{"step": e.step, "kind": e.kind, "message": e.message} for e in session.events]
    res["guard_replans"] = session.guard.replans
    session.close()
    del model, opt
    free_cached()
    return res


def _batch(model, spec: ModelSpec, rows: int, seq_len: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, model.config.vocab_size, (rows, seq_len), generator=gen)
    ids = ids.to(next(model.parameters()).device)
    return {"input_ids": ids, "labels": ids}
