"""The largest micro-batch per strategy at one budget, on the real SmolLM2-135M (measured).

The budget is HF full checkpointing's measured step peak at micro-batch ``--budget-batch`` (seq
``--seq``, AdamW fp32, its states present); then, each step measured with
`adacc_hf.measure_step_peak` (independent of any prediction):

* HF full checkpointing: the largest micro-batch whose step peak fits;
* Adacc (``--heads``: the chunked head, and optionally the model's own full logits): the largest
  micro-batch `prepare` plans under the budget whose measured step peak fits.

    python benchmarks/max_batch.py --out benchmarks/results/max-batch-cpu.json

Slow on CPU (a SmolLM2 step per point, a profile per Adacc point): minutes per point. Below
micro-batch ~4 the AdamW step (parameters, gradients, two states and the step's temporaries,
2268 MiB measured) sets HF full checkpointing's peak, not the activations: a budget taken there
fits no larger micro-batch under any strategy (the batch's own bytes grow), hence the default 8.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.append(str(ROOT))

from adacc_hf import assets, measure_step_peak, prepare  # noqa: E402
from adacc_hf.errors import BudgetError  # noqa: E402
from benchmarks.harness.smollm2 import lm_batch, model_and_optimizer, text_ids  # noqa: E402

MiB = 2**20


def hf_full_checkpointing(batch: dict) -> tuple[int, str]:
    """The measured step peak and the phase that sets it."""
    model, opt = model_and_optimizer()
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    step = measure_step_peak(model, batch, opt)
    del model, opt
    gc.collect()
    return step.peak_nbytes, max(step.phases, key=step.phases.__getitem__)


def adacc(batch: dict, budget: int, head: str) -> dict:
    model, opt = model_and_optimizer()
    t0 = time.perf_counter()
    try:
        session = prepare(model, budget, batch, optimizer="adamw_torch", adaptive=False, head=head)
    except BudgetError as e:
        return {"fits": False, "why": str(e).split(". ")[0]}
    plan_s = time.perf_counter() - t0
    policy = session.handle.policy
    predicted = policy.metadata.get("predicted", {}).get("peak_nbytes")
    peak = measure_step_peak(model, batch, opt).peak_nbytes
    session.close()
    del model, opt, session
    gc.collect()
    return {
        "fits": peak <= budget,
        "peak_nbytes": peak,
        "predicted_peak_nbytes": predicted,
        "head": policy.head,
        "plan_s": round(plan_s, 1),
        "summary": policy.summary(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=24)
    p.add_argument("--heads", nargs="+", default=["chunked"], choices=["chunked", "full", "auto"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    _, tokenizer = assets.load_smollm2()
    ids = text_ids(tokenizer, args.max_batch * args.seq)
    n0, seq = args.budget_batch, args.seq
    result: dict = {"model": "SmolLM2-135M", "seq": seq, "optimizer": "AdamW fp32"}

    def log(msg: str) -> None:
        print(msg, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")

    budget, phase = hf_full_checkpointing(lm_batch(ids, n0, seq))
    result.update(budget_batch=n0, budget_nbytes=budget, hf_full_checkpointing={n0: budget})
    log(f"budget: HF full checkpointing at micro-batch {n0}: {budget / MiB:.1f} MiB ({phase})")
    if phase == "optimizer":  # then no strategy fits a larger micro-batch: nothing to compare
        log("the optimizer step sets this budget: raise --budget-batch")
    hf_max = n0
    for b in range(n0 + 1, args.max_batch + 1):
        peak, phase = hf_full_checkpointing(lm_batch(ids, b, seq))
        result["hf_full_checkpointing"][b] = peak
        log(f"HF full checkpointing, micro-batch {b}: {peak / MiB:.1f} MiB ({phase})")
        if peak > budget:
            break
        hf_max = b
    result["hf_max_batch"] = hf_max
    for head in args.heads:
        runs: dict = {}
        result[f"adacc_{head}"] = runs
        best, b = 0, min(2 * hf_max, args.max_batch)
        tried_down = False
        while 1 <= b <= args.max_batch and b not in runs:
            r = runs[b] = adacc(lm_batch(ids, b, seq), budget, head)
            peak = r.get("peak_nbytes")
            log(
                f"Adacc (head {head}), micro-batch {b}: fits={r['fits']} "
                + (f"measured {peak / MiB:.1f} MiB" if peak else r.get("why", ""))
            )
            if r["fits"]:
                best = max(best, b)
                if tried_down:
                    break
                b += 1
            else:
                if best:
                    break
                tried_down = True
                b -= 1
        result[f"adacc_{head}_max_batch"] = best
        log(
            f"largest micro-batch at {budget / MiB:.1f} MiB: HF full checkpointing {hf_max}, "
            f"Adacc (head {head}) {best} (target >= {2 * hf_max})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
