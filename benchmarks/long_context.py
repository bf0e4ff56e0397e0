"""Long context on the real SmolLM2-135M: which sequence lengths each way of training fits in one
budget, every step measured.

    python benchmarks/long_context.py --out benchmarks/results/long-context-cpu.json

Micro-batch 1, fp32, AdamW with its states present, real Shakespeare text. The budget is HF full
checkpointing's measured step peak at the shortest length (``--lengths``, default 4096 8192).
At every length each method's training step is measured with `adacc_hf.measure_step_peak`
(every allocation of the step, independent of any prediction):

* ``hf_full``: transformers' ``activation_checkpointing_enable()`` (``every_n_layers=1``);
* ``hf_every_2``: ``every_n_layers=2`` (the best ``every_n_layers`` at long context is 1: every
  layer it leaves unchekpointed holds all its activations; 2 is shown for the trend);
* ``hf_full_offload``: transformers' ``offload=True``: its ``save_on_cpu`` around each checkpoint
  moves the checkpoint's saved inputs to the host, here the stand-in host of `runtime.offload`
  (buffers outside torch's allocator, counted off the device as pinned memory is off a GPU; on a
  CPU-only machine transformers' own hook would copy into memory the meter counts);
* ``adacc``: `prepare` at the budget with the chunked head and offload on (``offload=True``: the
  same stand-in host), no codecs (``codecs=[]``: retain / recompute / offload only).

The longest length that fits is reported per method, and, from the two peaks (affine in the
length for all four: SDPA keeps nothing quadratic), the longest length the budget would hold.
Slow on CPU: a SmolLM2 step at 8k tokens takes minutes; Adacc profiles each length first.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.append(str(ROOT))

from adacc_hf import assets, measure_step_peak, prepare  # noqa: E402
from adacc_hf.errors import BudgetError  # noqa: E402
from adacc_hf.runtime.offload import HostStore  # noqa: E402
from benchmarks.harness.smollm2 import lm_batch, model_and_optimizer, text_ids  # noqa: E402

MiB = 2**20
METHODS = ("hf_full", "hf_every_2", "hf_full_offload", "adacc")


def _hf_offload_on_stand_in(model) -> HostStore:
    """transformers' ``offload=True`` (a saved-tensor hook around each layer's checkpoint moving
    what it saves, the layer's inputs, to the host and back on use) with the stand-in host."""
    store = HostStore("cpu", cap_nbytes=2**40, prefetch=False)

    def offloaded_checkpoint(function, *args, **kwargs):
        frame = store.frame()
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: store.park(frame, t.detach()), lambda p: store.fetch(frame, p)
        )
        with hooks:
            return checkpoint(function, *args, **kwargs)

    fn = functools.partial(offloaded_checkpoint, use_reentrant=False)
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False):
            m._gradient_checkpointing_func = fn
    return store


def baseline(method: str, batch: dict) -> dict:
    model, opt = model_and_optimizer("sdpa")
    every = 2 if method == "hf_every_2" else 1
    model.activation_checkpointing_enable(every_n_layers=every)
    store = _hf_offload_on_stand_in(model) if method == "hf_full_offload" else None
    t0 = time.perf_counter()
    step = measure_step_peak(model, batch, opt)
    out = {
        "peak_nbytes": step.peak_nbytes,
        "phase": max(step.phases, key=step.phases.__getitem__),
        "step_s": round(time.perf_counter() - t0, 1),
    }
    if store is not None:
        out["host_peak_nbytes"] = store.peak_host_nbytes
    del model, opt
    gc.collect()
    return out


def adacc(batch: dict, budget: int) -> dict:
    model, opt = model_and_optimizer("sdpa")
    t0 = time.perf_counter()
    try:
        session = prepare(
            model,
            budget,
            batch,
            optimizer="adamw_torch",
            adaptive=False,
            head="chunked",
            offload=True,
            codecs=[],
            profile_repeats=1,
        )
    except BudgetError as e:
        return {"fits": False, "why": str(e).split(". ")[0]}
    plan_s = time.perf_counter() - t0
    policy = session.handle.policy
    t0 = time.perf_counter()
    step = measure_step_peak(model, batch, opt)
    host = session.handle.host
    out = {
        "peak_nbytes": step.peak_nbytes,
        "phase": max(step.phases, key=step.phases.__getitem__),
        "predicted_peak_nbytes": policy.metadata.get("predicted", {}).get("peak_nbytes"),
        "step_s": round(time.perf_counter() - t0, 1),
        "plan_s": round(plan_s, 1),
        "host_peak_nbytes": host.peak_host_nbytes if host is not None else 0,
        "summary": policy.summary(),
    }
    session.close()
    del model, opt, session
    gc.collect()
    return out


def longest(runs: dict[int, dict], budget: int) -> int | None:
    """The longest length the budget holds by the line through the two longest measured peaks."""
    pts = sorted((n, r["peak_nbytes"]) for n, r in runs.items() if "peak_nbytes" in r)
    if len(pts) < 2:
        return None
    (n0, p0), (n1, p1) = pts[-2], pts[-1]
    slope = (p1 - p0) / (n1 - n0)
    return int(n0 + (budget - p0) / slope) if slope > 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    _, tokenizer = assets.load_smollm2()
    lengths = sorted(args.lengths)
    ids = text_ids(tokenizer, lengths[-1])
    result: dict = {
        "model": "SmolLM2-135M (pretrained, SDPA)",
        "micro_batch": 1,
        "dtype": "fp32",
        "optimizer": "AdamW (states present)",
        "device": "cpu (offload: the stand-in host of adacc_hf.runtime.offload)",
        "lengths": lengths,
        "command": "python benchmarks/long_context.py " + " ".join(argv or sys.argv[1:]),
        "runs": {m: {} for m in args.methods},
    }

    def log(msg: str) -> None:
        print(msg, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")

    first = baseline("hf_full", lm_batch(ids, 1, lengths[0]))
    budget = first["peak_nbytes"]
    result["budget_nbytes"] = budget
    result["budget_how"] = f"HF full checkpointing's measured step peak at {lengths[0]} tokens"
    log(f"budget: {budget / MiB:.1f} MiB ({result['budget_how']}, set by {first['phase']})")
    for n in lengths:
        batch = lm_batch(ids, 1, n)
        for m in args.methods:
            if m == "hf_full" and n == lengths[0]:
                r = first
            else:
                r = adacc(batch, budget) if m == "adacc" else baseline(m, batch)
            r["fits"] = "peak_nbytes" in r and r["peak_nbytes"] <= budget
            result["runs"][m][n] = r
            peak = r.get("peak_nbytes")
            log(
                f"{m} at {n} tokens: "
                + (f"{peak / MiB:.1f} MiB ({r['phase']}), fits={r['fits']}" if peak else r["why"])
            )
    table = {}
    for m, runs in result["runs"].items():
        fit = [n for n, r in runs.items() if r.get("fits")]
        table[m] = {"longest_measured": max(fit, default=0), "longest_line": longest(runs, budget)}
    result["longest"] = table
    log(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
