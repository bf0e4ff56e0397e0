"""Offload on a GPU: the CUDA path of `runtime.offload` (pinned host buffers, a side stream,
events) run for real, against transformers' ``offload=True`` and HF full checkpointing.

    python benchmarks/gpu_offload.py                     # on a GPU, ~3 minutes
    python benchmarks/gpu_offload.py --smoke             # tiny, on any device (checks the driver)

SmolLM2-135M (the real weights where the asset is installed, else its config at random init),
bf16, fused AdamW, micro-batch 1, random tokens. The budget is HF full checkpointing's measured
step peak at the shorter length; at the longer one each method's step is measured:

* ``link``: the host link as `measure_link` prices it (pinned copies each way, side stream);
* ``peaks``: HF full, transformers' ``offload=True``, Adacc with offload (chunked head, no codecs)
  and Adacc without offload at the same budget: measured allocated / reserved peak against the
  budget, Adacc's prediction, its policy;
* ``grads``: the gradients of one step of each method against HF full's, beside HF full's own
  run-to-run spread (a race between the copy stream and the compute stream shows here);
* ``speed``: tokens/s of each, interleaved rounds, medians.

Writes ``results/offload-<gpu>.json`` (and a copy to ``$OUT`` when set).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.append(str(ROOT))

from adacc_hf import measure_step_peak, prepare  # noqa: E402
from adacc_hf.errors import BudgetError  # noqa: E402
from adacc_hf.runtime.offload import measure_link  # noqa: E402
from adacc_hf.solver.cost_model import predict  # noqa: E402
from benchmarks.harness.env import device_tag, header  # noqa: E402
from benchmarks.harness.models import SMOLLM2_CONFIG, ModelSpec, find_specs  # noqa: E402
from benchmarks.harness.patching import hf_enable  # noqa: E402
from benchmarks.harness.report import write_json  # noqa: E402
from benchmarks.harness.steps import optimizer_with_states  # noqa: E402

MiB = 2**20
RESULTS = ROOT / "benchmarks" / "results"


def _batch(vocab: int, n: int, device) -> dict:
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(4, vocab, (1, n), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(model, batch, opt) -> dict:
    try:
        measure_step_peak(model, batch, opt)  # warm: the allocator's segments exist
        p = measure_step_peak(model, batch, opt)
    except torch.cuda.OutOfMemoryError as e:
        opt.zero_grad(set_to_none=True)
        return {"oom": str(e).splitlines()[0]}
    return {
        "peak_nbytes": p.peak_nbytes,
        "reserved_peak_nbytes": p.reserved_peak_nbytes,
        "phases": p.phases,
    }


def _grads(model, batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    g = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return g


def _top_moments(session, policy, n: int = 6) -> dict[str, int]:
    """The prediction's highest moments (which part of the step the model says peaks)."""
    pred = predict(session.profile, policy, session.ctx.static_memory())
    return dict(sorted(pred.moments.items(), key=lambda kv: -kv[1])[:n])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _step_s(model, batch, opt, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs=2, default=None, help="budget length, run length")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no CUDA device: this check measures a GPU's offload path (--smoke runs it tiny)")
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.smoke:
        tiny = dict(SMOLLM2_CONFIG, vocab_size=256, hidden_size=64, intermediate_size=128)
        tiny.update(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
        spec = ModelSpec("llama-smoke", "llama", tiny, seq_len=64, batch_sizes=(1,), main_batch=1)
        short, long = args.lengths or (128, 256)
    else:
        (spec,) = find_specs("gpu", ["smollm2-135m"])
        short, long = args.lengths or (8192, 16384)
    tag = "smoke" if args.smoke else device_tag(device)
    out_path = Path(args.results) / f"offload-{tag}.json"
    base, weights = spec.build(torch.device("cpu"), torch.float32)
    base.train()
    vocab = base.config.vocab_size
    res: dict[str, Any] = header("gpu-offload", argv, device)
    res.update(model=spec.name, weights=weights, dtype=str(dtype), lengths=[short, long])

    def log(msg: str) -> None:
        print(msg, flush=True)
        write_json(out_path, res)

    link = measure_link(device)
    res["link"] = dataclasses.asdict(link)
    log(f"link: {res['link']}")

    def fresh():
        m = copy.deepcopy(base).to(device=device, dtype=dtype)
        m.train()
        return m, optimizer_with_states(m, fused=cuda)

    hf, hf_opt = fresh()
    hf_enable(hf, offload=False)
    budget_row = _peak(hf, _batch(vocab, short, device), hf_opt)
    budget = budget_row["peak_nbytes"]
    res["budget_nbytes"] = budget
    res["budget_how"] = f"HF full checkpointing's measured step peak at {short} tokens"
    log(f"budget {budget / MiB:.1f} MiB ({res['budget_how']})")
    batch = _batch(vocab, long, device)
    models: dict[str, tuple[Any, Any]] = {"hf_full": (hf, hf_opt)}
    if cuda:  # on a CPU the host is the device: offload would move nothing off it
        m, o = fresh()
        hf_enable(m, offload=True)  # transformers' offload=True, or its hook where it predates it
        models["hf_offload"] = (m, o)
    sessions: dict[str, Any] = {}

    def plan(name: str, budget_nbytes: int, offload: bool) -> int | None:
        """Adacc at `budget_nbytes`; on no fit, the least budget the error names."""
        m, o = fresh()
        t0 = time.perf_counter()
        try:
            s = prepare(
                m, budget_nbytes, batch, optimizer=o, adaptive=False, head="chunked",
                offload=offload, codecs=[], profile_repeats=2,
            )  # fmt: skip
        except BudgetError as e:
            least = re.search(r"smallest feasible budget is [^(]*\((\d+) bytes\)", str(e))
            res.setdefault("least", {})[name] = int(least.group(1)) if least else None
            log(f"{name} at {budget_nbytes / MiB:.1f} MiB: infeasible: {str(e)[:160]}")
            return int(least.group(1)) if least else None
        pol = s.handle.policy
        res[name] = {
            "budget_nbytes": budget_nbytes,
            "plan_s": round(time.perf_counter() - t0, 1),
            "predicted_peak_nbytes": pol.metadata.get("predicted", {}).get("peak_nbytes"),
            "summary": pol.summary(),
            "predicted_moments": _top_moments(s, pol),
        }
        log(f"{name}: planned in {res[name]['plan_s']} s: {pol.summary()}")
        sessions[name] = s
        models[name] = (m, o)
        return None

    # the least budgets with and without offload (each plan's error names it), then Adacc at
    # HF full's short-length peak and between the two least budgets (where only offload fits)
    least_no = plan("least_no_offload", 1, offload=False)
    least_off = plan("least_offload", 1, offload=True)
    if plan("adacc_offload", budget, offload=True) and least_off:
        plan("adacc_offload_least", least_off, offload=True)
    plan("adacc_no_offload", budget, offload=False)
    if least_no and least_off and least_off < least_no:
        plan("adacc_offload_tight", (least_no + least_off) // 2, offload=True)

    res["peaks"] = {}
    for name, (m, o) in models.items():
        row = res["peaks"][name] = _peak(m, batch, o)
        if "peak_nbytes" in row:
            cap = res[name]["budget_nbytes"] if name in sessions else budget
            row["fits"] = row["peak_nbytes"] <= cap
            if row["reserved_peak_nbytes"] is not None:
                row["reserved_fits"] = row["reserved_peak_nbytes"] <= cap
        if name in sessions and sessions[name].handle.host is not None:
            row["host_peak_nbytes"] = sessions[name].handle.host.peak_host_nbytes
        log(f"{name} at {long} tokens: {row}")

    ref = _grads(hf, batch)
    res["grads"] = {"hf_full_spread": _rel(_grads(hf, batch), ref)}
    for name, (m, _) in models.items():
        if name != "hf_full":
            res["grads"][name] = _rel(_grads(m, batch), ref)
    del ref
    log(f"grads (relative to HF full): {res['grads']}")

    times: dict[str, list[float]] = {n: [] for n in models}
    for m, o in models.values():
        _step_s(m, batch, o, device)  # warm
    for _ in range(args.rounds):
        for name, (m, o) in models.items():
            if "oom" not in res["peaks"][name]:
                times[name].append(_step_s(m, batch, o, device))
    res["tokens_per_s"] = {n: long / statistics.median(t) for n, t in times.items() if t}
    hf_tps = res["tokens_per_s"].get("hf_full")
    res["speed_vs_hf_full"] = (
        {n: t / hf_tps for n, t in res["tokens_per_s"].items()} if hf_tps else {}
    )
    log(f"tokens/s: {res['tokens_per_s']}; vs HF full: {res['speed_vs_hf_full']}")
    for s in sessions.values():
        s.close()
    models.clear()
    sessions.clear()
    gc.collect()
    if os.environ.get("OUT"):
        shutil.copy(out_path, os.environ["OUT"])
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
