"""The sections of the first GPU check (`benchmarks/gpu_first.py`), each on its own time share.

* `run_tests`: the library's own tests on the device (``ADACC_TEST_DEVICE``), in a subprocess,
  streamed: what passed, failed or did not run before the share ran out, and the log.
* `codec_bandwidth`: every codec's kernels against a plain copy (GB/s) at several sizes.
* `step_peaks`: Adacc's solved policy at several budgets: measured step peaks (allocated, and on
  CUDA reserved) against the cost model's prediction and the budget, beside HF full
  checkpointing and no checkpointing.
* `throughput`: tokens/s of Adacc against HF full checkpointing, the best transformers
  ``every_n_layers`` that fits and no checkpointing at one tight budget, interleaved.

Each returns a JSON-able dict; none raises for a failure inside the section (the driver records
the error and goes on to the next section).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from adacc_hf import estimate_static_memory, measure_step_peak, uniform_policy
from adacc_hf.runtime.allocator import ENV_VAR as ADACC_ENV
from adacc_hf.runtime.allocator import allocator_configured, use_expandable_segments
from adacc_hf.solver import predict

from .adacc import budget_range, profile_for
from .env import Deadline
from .memory import free_cached, oom_errors
from .models import ModelSpec
from .prepared import Prepared
from .report import MiB
from .steps import median, step_stats, time_interleaved
from .strategies import build, every_n, prepare

ROOT = Path(__file__).resolve().parents[2]
_RESULT = re.compile(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")
_NODE = re.compile(r"(tests/\S+\.py::\S+)")


def run_tests(
    files: list[str], *, device: str, limit_s: float, log: Path, extra: list[str]
) -> dict:
    """pytest over `files` with ``ADACC_TEST_DEVICE=device``, stopped after `limit_s` seconds.

    Outcomes are read from pytest's verbose lines as they stream (also when stopped early); the
    whole output goes to `log`.
    """
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE", *files, *extra]
    env = dict(os.environ, ADACC_TEST_DEVICE=device, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    outcomes: dict[str, str] = {}
    t0 = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        stopped = False
        for line in _lines_until(proc, t0 + limit_s):
            f.write(line)
            node, res = _NODE.search(line), _RESULT.search(line)
            if node and res and "::" in node.group(1):
                outcomes.setdefault(node.group(1), res.group(1))
        if proc.poll() is None:
            stopped = True
            proc.kill()
        rc = proc.wait()
    counts: dict[str, int] = {}
    for r in outcomes.values():
        counts[r] = counts.get(r, 0) + 1
    return {
        "command": " ".join(cmd[1:]),
        "device": device,
        "seconds": time.perf_counter() - t0,
        "returncode": rc,
        "stopped_at_limit": stopped,
        "counts": counts,
        "failed": sorted(n for n, r in outcomes.items() if r in ("FAILED", "ERROR")),
        "log": log.name,
    }


def _lines_until(proc: subprocess.Popen, deadline: float):
    """The process's output lines until it ends or `deadline` (perf_counter) passes."""
    import selectors

    sel = selectors.DefaultSelector()
    assert proc.stdout is not None
    sel.register(proc.stdout, selectors.EVENT_READ)
    while time.perf_counter() < deadline:
        if not sel.select(timeout=max(0.0, min(1.0, deadline - time.perf_counter()))):
            if proc.poll() is not None:
                break
            continue
        line = proc.stdout.readline()
        if not line:
            break
        yield line
    sel.close()


def codec_bandwidth(
    codecs: list[str], sizes_mb: list[float], device: torch.device, *, deadline: Deadline, **kw: Any
) -> dict:
    """`bench_codecs`' rows (kernel vs reference vs copy) until the section's time runs out."""
    from . import codecs as bench

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    copy = bench.copy_bandwidth(sizes_mb, device, dtype, kw.get("reps", 5))
    rows, skipped = [], []
    for name in codecs:
        for mb in sizes_mb:
            if deadline.passed():
                skipped.append(f"{name}@{mb}MB")
                continue
            row = bench.bench_codec(
                name,
                mb,
                device,
                dtype,
                channels=kw.get("channels", 4096),
                reps=kw.get("reps", 5),
                device_copy=copy[mb],
            )
            rows.append(row)
            print(
                f"  {name:13s} {mb:>6g} MB: encode {row['encode_gbps']:7.1f} GB/s "
                f"({row['encode_copy_ratio']:.2f} copy), decode {row['decode_gbps']:7.1f} GB/s "
                f"({row['decode_copy_ratio']:.2f}), exact {row['bit_exact_payload']}",
                flush=True,
            )
        free_cached()
    return {"dtype": str(dtype), "copy_gbps": copy, "rows": rows, "skipped": skipped}


def _measure(s: Prepared, batch: dict, optimizer: torch.optim.Optimizer) -> dict:
    """Step peaks of one strategy (second step: optimizer states exist), from an emptied cache."""
    free_cached()
    out: dict[str, Any] = {"label": s.label}
    try:
        with s:
            measure_step_peak(s.model, batch, optimizer)
            free_cached()
            p = measure_step_peak(s.model, batch, optimizer)
        out.update(peak_nbytes=p.peak_nbytes, reserved_peak_nbytes=p.reserved_peak_nbytes)
    except oom_errors() as e:
        out.update(oom=True, error=str(e).splitlines()[0])
        optimizer.zero_grad(set_to_none=True)
    free_cached()
    return out


def _model(spec: ModelSpec, device: torch.device, dtype: torch.dtype):
    model, weights = spec.build(device, dtype)
    fused = device.type == "cuda"
    static = estimate_static_memory(
        model, optimizer="adamw_torch_fused" if fused else "adamw_torch"
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if fused else {}))
    return model, weights, static, opt


def _header(spec: ModelSpec, weights: str, dtype, batch_size: int, lo: int, hi: int) -> dict:
    """What a section's JSON says first: the model, its batch and its budget range."""
    return {
        "model": spec.name,
        "weights": weights,
        "dtype": str(dtype),
        "batch": batch_size,
        "seq_len": spec.seq_len,
        "min_budget_nbytes": lo,
        "no_checkpoint_need_nbytes": hi,
    }


def step_peaks(
    spec: ModelSpec,
    batch_size: int,
    fractions: list[float],
    device: torch.device,
    dtype,
    *,
    deadline: Deadline,
    repeats: int,
) -> dict:
    """Adacc at budgets ``lo + f (hi - lo)``: measured peaks against prediction and budget."""
    model, weights, static, opt = _model(spec, device, dtype)
    batch = spec.batch(model, batch_size)
    t0 = time.perf_counter()
    profiles = profile_for(model, batch, repeats, no_outlier=False)
    lo, hi = budget_range(profiles.adacc, static)
    res: dict[str, Any] = {
        **_header(spec, weights, dtype, batch_size, lo, hi),
        "static_nbytes": static.total,
        "profile_s": time.perf_counter() - t0,
        "baselines": {},
        "budgets": [],
    }
    print(
        f"[{spec.name}] profile {res['profile_s']:.1f} s; budgets {lo / MiB:.0f}-{hi / MiB:.0f} MiB",
        flush=True,
    )
    ready = build(["none", "hf_full"], model, batch, budget_nbytes=None, static_nbytes=static)
    for name, s in ready.items():
        row = res["baselines"][name] = _measure(s, batch, opt)
        pol = uniform_policy(model, "retain" if name == "none" else "recompute", batch)
        row["predicted_peak_nbytes"] = predict(profiles.adacc, pol, static).peak_nbytes
        _print_peak(spec.name, name, row)
    measured: list[tuple[dict, Prepared]] = [(res["baselines"][n], s) for n, s in ready.items()]
    for f in fractions:
        if deadline.passed():
            res["budgets"].append({"fraction": f, "skipped": "time limit"})
            continue
        budget = int(lo + f * (hi - lo))
        t1 = time.perf_counter()
        s = prepare(
            "adacc",
            model,
            batch,
            budget_nbytes=budget,
            static_nbytes=static,
            profiles=profiles,
            profile_repeats=repeats,
        ).prepare()
        row = {"fraction": f, "budget_nbytes": budget, "plan_s": time.perf_counter() - t1}
        if not s.fits_budget:
            row["infeasible"] = s.info.get("error")
        else:
            row.update(_measure(s, batch, opt))
            measured.append((row, s))
            pred = predict(
                s.session.current.profile if s.session and s.session.current else profiles.adacc,
                s.policy,
                static,
            )
            row.update(
                predicted_peak_nbytes=pred.peak_nbytes,
                summary=s.policy.summary(),
                predicted_added_ms=pred.added_ms,
            )
            for key in ("peak_nbytes", "reserved_peak_nbytes"):
                if row.get(key) is not None:
                    row[key.replace("nbytes", "over_budget")] = row[key] / budget - 1
        res["budgets"].append(row)
        _print_peak(spec.name, f"adacc@{f:g}", row, budget)
    res["allocator"] = _expandable_again(measured, batch, opt, deadline)
    del model, opt
    free_cached()
    return res


def _expandable_again(
    measured: list[tuple[dict, Prepared]], batch: dict, opt: torch.optim.Optimizer, deadline
) -> str:
    """The same strategies again under expandable segments, as sessions set CUDA up: each row
    gains ``expandable_peak_nbytes`` / ``expandable_reserved_peak_nbytes``. Returns what ran."""
    if not torch.cuda.is_available():
        return "CPU: no caching allocator"
    if not use_expandable_segments():
        return f"left as configured ({allocator_configured() or ADACC_ENV + '=default'})"
    free_cached()
    for row, s in measured:
        if deadline.passed():
            return "expandable segments: stopped at the time limit"
        again = _measure(s, batch, opt)
        row["expandable_peak_nbytes"] = again.get("peak_nbytes")
        row["expandable_reserved_peak_nbytes"] = again.get("reserved_peak_nbytes")
        if row.get("budget_nbytes") and again.get("reserved_peak_nbytes"):
            row["expandable_reserved_over_budget"] = (
                again["reserved_peak_nbytes"] / row["budget_nbytes"] - 1
            )
        print(
            f"  expandable: {s.name:8s} peak {(again.get('peak_nbytes') or 0) / MiB:.1f} "
            f"reserved {(again.get('reserved_peak_nbytes') or 0) / MiB:.1f} MiB",
            flush=True,
        )
    return "default, then expandable segments (expandable_* fields)"


def _print_peak(model: str, name: str, row: dict, budget: int | None = None) -> None:
    def mib(k: str) -> str:
        v = row.get(k)
        return "-" if v is None else f"{v / MiB:.1f}"

    b = "" if budget is None else f" budget {budget / MiB:.1f}"
    print(
        f"[{model}] {name:12s} peak {mib('peak_nbytes')} reserved {mib('reserved_peak_nbytes')} "
        f"predicted {mib('predicted_peak_nbytes')} MiB{b}",
        flush=True,
    )


def throughput(
    spec: ModelSpec,
    batch_size: int,
    fraction: float,
    device: torch.device,
    dtype,
    *,
    deadline: Deadline,
    rounds: int,
    steps: int,
    repeats: int,
) -> dict:
    """Tokens/s at one tight budget: Adacc, HF full, the best fitting ``every_n_layers``, none."""
    model, weights, static, opt = _model(spec, device, dtype)
    batch = spec.batch(model, batch_size)
    profiles = profile_for(model, batch, repeats, no_outlier=False)
    lo, hi = budget_range(profiles.adacc, static)
    budget = int(lo + fraction * (hi - lo))
    res: dict[str, Any] = {
        **_header(spec, weights, dtype, batch_size, lo, hi),
        "budget_nbytes": budget,
        "budget_fraction": fraction,
        "profile_s": profiles.profile_s,
        "every_n_tried": {},
        "strategies": {},
    }
    kw = dict(
        budget_nbytes=budget, static_nbytes=static, profiles=profiles, profile_repeats=repeats
    )
    ready = build(["none", "hf_full", "adacc"], model, batch, **kw)
    layers = getattr(model.config, "num_hidden_layers", 2)
    best, measured = None, {}
    for k in sorted(
        {k for k in (layers, layers // 2, 6, 4, 3, 2) if 2 <= k <= layers}, reverse=True
    ):
        if deadline.passed():
            break
        s = every_n(k).kind(every_n(k), model, batch, **kw)
        mem = _measure(s, batch, opt)
        res["every_n_tried"][str(k)] = mem
        if not mem.get("oom") and mem["peak_nbytes"] <= budget:
            best = s.name
            ready[best], measured[best] = s, mem
            break
    res["best_every_n"] = best
    for name, s in ready.items():
        row = res["strategies"][name] = measured.get(name) or (
            _measure(s, batch, opt) if s.fits_budget else {"infeasible": True}
        )
        row["fits"] = bool(row.get("peak_nbytes") is not None and row["peak_nbytes"] <= budget)
    runnable = {
        n: s for n, s in ready.items() if s.fits_budget and not res["strategies"][n].get("oom")
    }
    times = time_interleaved(
        runnable,
        model,
        batch,
        opt,
        rounds=rounds,
        steps=steps,
        warmup=1,
        errors=oom_errors(),
        on_error=lambda n, e: free_cached(),
    )
    tokens = batch_size * spec.seq_len
    for n, ts in times.items():
        res["strategies"][n].update(step_stats(ts, tokens))
    base = res["strategies"].get("hf_full", {}).get("tokens_per_s")
    for n, r in res["strategies"].items():
        if base and r.get("tokens_per_s"):
            r["ratio_vs_hf_full"] = r["tokens_per_s"] / base
        print(
            f"[{spec.name}] {n:12s} {r.get('tokens_per_s', float('nan')):9.0f} tok/s "
            f"peak {(r.get('peak_nbytes') or 0) / MiB:8.1f} MiB fits {r['fits']}",
            flush=True,
        )
    res["adacc_summary"] = ready["adacc"].policy.summary() if ready["adacc"].policy else None
    res["median_step_ms"] = {n: median(ts) * 1e3 for n, ts in times.items()}
    del model, opt, ready, runnable
    free_cached()
    return res
