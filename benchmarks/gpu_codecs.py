"""The codecs GPU check: does compression pay on the device? One device call of <= 6 minutes.

    python benchmarks/gpu_suite.py --part codecs      # on the GPU: results/codecs-<gpu>.json
    python benchmarks/gpu_codecs.py --smoke           # the same sections, tiny, on any device

Sections, each on its share of the time limit (`SHARES_S`; one that runs out stops starting new
work and lists what it skipped; a failing one is recorded and the next runs); the JSON is
written after every section:

1. ``env``: GPU, versions, which codec backends can run.
2. ``device``: what a device table prices work with, measured rather than taken from a datasheet:
   copy bandwidth, bf16 matmul and fused-attention throughput at the 1.1B LLaMA's shapes, the
   host's cost of issuing an op and of crossing a Python dispatch mode, the host link.
3. ``codecs``: every codec x backend at 16 / 64 / 256 MB against a copy, bit-exact against the
   torch reference (`benchmarks/device_table.py` reads these rows into the device's table).
4. ``plans``: the 1.1B LLaMA config, 4 x 2048, bf16, fused AdamW, at fractions 0.25 and 0.5 of
   its budget window, profiled with every codec allowed (the library formats too) on the fastest
   of each codec's backends: the actions chosen and, for each op not compressed, why
   (`adacc_hf.solver.explain`); tokens/s of Adacc, HF full checkpointing and none in interleaved
   rounds; allocated and reserved peaks; the gradients' relative error against HF full's.
5. ``compiled``: the plan at 0.25 planned for ``torch.compile`` (the profile measured compiled)
   and run compiled, as time allows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.append(str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"
TIME_LIMIT_S = 330  # of the 6 minutes: ~30 s for imports and the wheels
SECTIONS = ("env", "device", "codecs", "plans", "compiled")
SHARES_S = {"env": 5, "device": 25, "codecs": 90, "plans": 150, "compiled": 60}


def settings(smoke: bool) -> dict[str, Any]:
    from adacc_hf.codecs import available_codecs
    from benchmarks.harness.models import find_specs

    if smoke:
        tiny = dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        return {
            "sizes_mb": [1 / 64],
            "channels": 256,
            "reps": 1,
            "codecs": ["int4_outlier", "nf4", "mxfp8"],  # a kernel, bitsandbytes, torchao
            "model": tiny,
            "batch": (2, 64),
            "fractions": [0.25],
            "rounds": 1,
            "steps": 1,
            "matmul": [(256, 64, 128)],
            "attention": [(2, 4, 2, 64, 16)],
        }
    return {
        "sizes_mb": [16, 64, 256],
        "channels": 4096,
        "reps": 5,
        "codecs": available_codecs(),
        "model": find_specs("gpu", ["llama-1b"])[0].config,
        "batch": (4, 2048),
        "fractions": [0.25, 0.5],
        "rounds": 3,
        "steps": 2,
        # (tokens, in, out) of the block's projections; (batch, heads, kv heads, seq, head dim)
        "matmul": [(8192, 2048, 2048), (8192, 2048, 5632), (8192, 5632, 2048)],
        "attention": [(4, 32, 4, 2048, 64), (1, 9, 3, 16384, 64)],
    }


def device_section(device, cfg: dict) -> dict:
    """Copy, matmul and attention throughput, the host's costs, the link (see the docstring)."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    from adacc_hf.runtime.offload import measure_link
    from benchmarks.harness import codecs as bench

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict[str, Any] = {
        "copy_gbps": bench.copy_bandwidth(cfg["sizes_mb"], device, dtype, cfg["reps"])
    }
    mm = []
    for m, k, n in cfg["matmul"]:
        a, b = (
            torch.randn(m, k, device=device, dtype=dtype),
            torch.randn(k, n, device=device, dtype=dtype),
        )
        s = bench.median_s(lambda a=a, b=b: a @ b, device, cfg["reps"])
        mm.append({"shape": [m, k, n], "ms": s * 1e3, "tflops": 2 * m * k * n / s / 1e12})
    out["matmul"] = mm
    att = []
    for bsz, h, kv, seq, d in cfg["attention"]:
        q = torch.randn(bsz, h, seq, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(bsz, kv, seq, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)

        def fwd(q=q, k=k, v=v, gqa=kv != h):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

        def both(q=q, k=k, v=v):
            fwd(q, k, v).sum().backward()

        flops = 4 * bsz * h * seq * seq * d / 2
        s_f, s_b = (
            bench.median_s(fwd, device, cfg["reps"]),
            bench.median_s(both, device, cfg["reps"]),
        )
        att.append(
            {
                "shape": [bsz, h, kv, seq, d],
                "forward_tflops": flops / s_f / 1e12,
                "backward_tflops": 2.5 * flops / max(s_b - s_f, 1e-9) / 1e12,
            }
        )
    out["attention"] = att
    x = torch.zeros(1, device=device)
    n = 2000

    def issue():  # host-bound: tiny kernels back to back, then one sync
        for _ in range(n):
            x.add_(1)

    class NoOp(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def crossing():
        with NoOp():
            issue()

    t_op = bench.median_s(issue, device, cfg["reps"]) / n
    t_mode = bench.median_s(crossing, device, cfg["reps"]) / n
    out["host"] = {"op_us": t_op * 1e6, "mode_crossing_us": (t_mode - t_op) * 1e6}
    link = measure_link(device) if device.type == "cuda" else None
    out["link"] = None if link is None else {
        "d2h_gbps": link.d2h_gbps, "h2d_gbps": link.h2d_gbps, "launch_ms": link.launch_ms
    }  # fmt: skip
    return out


def codecs_section(device, cfg: dict, deadline) -> dict:
    import torch

    from benchmarks.harness import codecs as bench
    from benchmarks.harness.memory import free_cached

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    copy = bench.copy_bandwidth(cfg["sizes_mb"], device, dtype, cfg["reps"])
    rows, skipped = [], []
    for name in cfg["codecs"]:
        for mb in cfg["sizes_mb"]:
            if deadline.passed():
                skipped.append(f"{name}@{mb}MB")
                continue
            for r in bench.bench_backends(
                name, mb, device, dtype, channels=cfg["channels"], reps=cfg["reps"],
                device_copy=copy[mb],
            ):  # fmt: skip
                rows.append(r)
                if "unavailable" not in r:
                    print(
                        f"  {name:14s} {r['backend']:12s} {mb:>6g} MB: encode "
                        f"{r['encode_copy_ratio']:.2f} / decode {r['decode_copy_ratio']:.2f} "
                        f"of a copy, exact {r['bit_exact_payload'] and r['bit_exact_decode']}",
                        flush=True,
                    )
        free_cached()
    return {"dtype": str(dtype), "copy_gbps": copy, "rows": rows, "skipped": skipped}


def plans_section(device, cfg: dict, deadline, compiled: bool = False) -> dict:
    """Adacc with every codec allowed against HF full and none (see the module docstring)."""
    import torch
    import transformers

    from adacc_hf import profile_model
    from adacc_hf.solver import estimate_static_memory
    from adacc_hf.solver.explain import not_compressed
    from benchmarks.harness.adacc import Profiles, budget_range
    from benchmarks.harness.first import _measure
    from benchmarks.harness.memory import free_cached, oom_errors
    from benchmarks.harness.steps import step_stats, time_interleaved
    from benchmarks.harness.strategies import build

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = transformers.LlamaConfig(**cfg["model"], use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).train()
    bsz, seq = cfg["batch"]
    ids = torch.randint(
        4, config.vocab_size, (bsz, seq), generator=torch.Generator().manual_seed(0)
    )
    batch = {"input_ids": ids.to(device), "labels": ids.to(device), "use_cache": False}
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **({"fused": True} if fused else {}))
    static = estimate_static_memory(
        model, optimizer="adamw_torch_fused" if fused else "adamw_torch"
    )
    codecs = cfg["codecs"]
    t0 = time.perf_counter()
    probes: dict = {}
    # inductor's per-shape compiles would take this section's minutes: the codecs section
    # measures that backend
    backends = [b for b in ("triton", "torch", "bitsandbytes", "torchao")]
    prof = profile_model(
        model, batch, codecs=codecs, repeats=cfg["reps"], probes=probes, codec_backends=backends
    )
    profiles = Profiles(prof, None, time.perf_counter() - t0, probes)
    lo, hi = budget_range(prof, static)
    out: dict[str, Any] = {"profile_s": profiles.profile_s, "window": [lo, hi], "fractions": {}}
    tokens = bsz * seq
    grads_ref = None
    for fraction in cfg["fractions"]:
        if deadline.passed():
            out.setdefault("skipped", []).append(fraction)
            continue
        budget = int(lo + fraction * (hi - lo))
        kw = dict(budget_nbytes=budget, static_nbytes=static, profiles=profiles)
        ready = build(["none", "hf_full", "adacc"], model, batch, **kw)
        adacc = ready["adacc"]
        row: dict[str, Any] = {"budget_nbytes": budget, "strategies": {}}
        if adacc.policy is not None:
            row["summary"] = adacc.policy.summary()
            row["predicted"] = adacc.policy.metadata.get("predicted", {})
            why = not_compressed(adacc.session.profile, adacc.policy)
            row["not_compressed"] = {g: r for g, r in why.items()}
            row["backends"] = sorted(
                {a.backend or "auto" for g in adacc.policy.groups.values() for v in g.variants
                 for a in v.actions.values() if a.codec}
            )  # fmt: skip
        for name, s in ready.items():
            row["strategies"][name] = (
                _measure(s, batch, opt) if s.fits_budget else {"infeasible": True}
            )
        runnable = {n: s for n, s in ready.items() if s.fits_budget}
        times = time_interleaved(
            runnable, model, batch, opt, rounds=cfg["rounds"], steps=cfg["steps"], warmup=1,
            errors=oom_errors(), on_error=lambda n, e: free_cached(),
        )  # fmt: skip
        for n, ts in times.items():
            if ts:
                row["strategies"][n].update(step_stats(ts, tokens))
        hf = row["strategies"].get("hf_full", {}).get("tokens_per_s")
        for r in row["strategies"].values():
            if hf and r.get("tokens_per_s"):
                r["ratio_vs_hf_full"] = r["tokens_per_s"] / hf
        # gradients against HF full's (one step each, the same batch and seed)
        grads = {}
        for n in ("hf_full", "adacc"):
            if n in runnable:
                with runnable[n]:
                    model.zero_grad(set_to_none=True)
                    torch.manual_seed(0)
                    model(**batch).loss.backward()
                    grads[n] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
                model.zero_grad(set_to_none=True)
        if "hf_full" in grads and "adacc" in grads:
            ref = grads_ref = grads["hf_full"]
            row["grad_error_vs_hf_full"] = float((grads["adacc"] - ref).norm() / ref.norm())
        del grads
        print(
            f"  fraction {fraction}: {row.get('summary')}; {row['strategies'].get('adacc')}",
            flush=True,
        )
        out["fractions"][str(fraction)] = row
        free_cached()
    del grads_ref
    if compiled and not deadline.passed():
        out["compiled"] = _compiled(model, batch, opt, lo + cfg["fractions"][0] * (hi - lo), cfg)
    return out


def _compiled(model, batch, opt, budget: float, cfg: dict) -> dict:
    """The first fraction's plan planned for and run under torch.compile."""
    import torch

    import adacc_hf
    from adacc_hf import measure_step_peak
    from adacc_hf.runtime.timing import time_call
    from benchmarks.harness.steps import train_step

    device = next(model.parameters()).device
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    session = adacc_hf.prepare(
        model, int(budget), batch, optimizer=opt, adaptive=False, compile=backend
    )
    try:
        compiled = torch.compile(model, backend=backend)
        train_step(compiled, batch, opt)  # compiles
        ms = [time_call(lambda: train_step(compiled, batch, opt), device, 1) for _ in range(3)]
        peak = measure_step_peak(compiled, batch, opt)
        policy = session.handle.policy if session.handle is not None else None
        return {
            "backend": backend,
            "summary": policy.summary() if policy is not None else None,
            "step_ms": sorted(ms)[1],
            "peak_nbytes": peak.peak_nbytes,
            "reserved_peak_nbytes": peak.reserved_peak_nbytes,
        }
    finally:
        session.close()
        torch._dynamo.reset()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, any device")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--tag", default=None)
    p.add_argument("--time-limit", type=float, default=TIME_LIMIT_S)
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    args = p.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is defined
        if args.sections == list(SECTIONS):  # compiling the model costs minutes on a CPU
            args.sections = [s for s in SECTIONS if s != "compiled"]
    import torch

    from benchmarks.harness.env import device_tag, header
    from benchmarks.harness.report import write_json
    from benchmarks.harness.sections import run_sections

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("no CUDA device here: this check measures a GPU (--smoke runs it tiny)")
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    tag = args.tag or ("smoke" if args.smoke else device_tag(device))
    path = Path(args.results) / f"codecs-{tag}.json"
    cfg = settings(args.smoke)
    out: dict[str, Any] = header("gpu-codecs", argv, device)
    out.update(smoke=args.smoke, time_limit_s=args.time_limit, shares_s=SHARES_S)

    def run(name: str, share) -> dict[str, Any]:
        if name == "env":
            from adacc_hf.codecs import available_codecs, backends

            return {
                "gpu": torch.cuda.get_device_name(0) if cuda else None,
                "backends": {
                    c: {
                        b: backends.unavailable(c, b, device) or "runs"
                        for b in backends.backends_of(c)
                    }
                    for c in available_codecs()
                },
            }
        if name == "device":
            return device_section(device, cfg)
        if name == "codecs":
            return codecs_section(device, cfg, share)
        if name == "plans":
            return plans_section(device, cfg, share)
        res = plans_section(device, dict(cfg, fractions=cfg["fractions"][:1]), share, compiled=True)
        return {"compiled": res.get("compiled"), "eager": res["fractions"]}

    def after(name: str, res: dict[str, Any]) -> None:
        if os.environ.get("OUT"):
            write_json(Path(os.environ["OUT"]) / path.name, out)

    shares = {n: SHARES_S[n] for n in args.sections}
    limit = args.time_limit * sum(shares.values()) / TIME_LIMIT_S
    deadline = run_sections(args.sections, shares, limit, run, out, path, after=after)
    print(f"wrote {path} ({deadline})", flush=True)
    return 1 if any("error" in r for r in out["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
