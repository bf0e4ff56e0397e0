"""Adacc under ``torch.compile`` against compiled HF checkpointing, at one budget, side by side.

    python benchmarks/compiled.py --out benchmarks/results/compiled-cpu.json
    python benchmarks/compiled.py --device cuda --model gpt2-117m --batch 8   # bf16 on a GPU

One model of the CPU preset (default llama-cpu, 4 x 256), AdamW with its states present. The
budget is `--fraction` of the way from full recomputation's predicted step peak to no
checkpointing's. Each way runs on its own copy of the same weights, all alive at once:

* ``hf_full_compiled``: transformers' full checkpointing, then ``torch.compile(model)``;
* ``adacc_compiled``: `prepare(..., compile="inductor")` at the budget (the profile measured on
  the compiled blocks, head and step: `profiler.compiled`), then ``torch.compile(model)``
  (retain / recompute as selective-checkpoint tags);
* ``adacc_eager``: `prepare(..., codecs=[], offload=False)`, not compiled (its own plan);
* ``compile_budget``: ``torch.compile`` with ``activation_memory_budget`` 1 / 0.5 / 0.25 / 0,
  the first whose measured step peak fits the budget (absent when none fits).

Every way's step peak is measured (`measure_step_peak`, every allocation; the plan's prediction
beside Adacc's), then steps are timed in interleaved rounds: each round visits the ways in a
seeded random order, and each way runs one untimed step, then `--steps` timed ones (the round's
median). The per-round ratios are compared (median, 90 % bootstrap interval, and a verdict against
a bar: Adacc compiled >= 0.98x HF full compiled, >= 1x Adacc eager and >= 1x the compile budget;
`benchmarks.harness.stats`) on the process's CPU time on a CPU (a shared machine's other jobs
then slow no way's clock; wall times are kept beside) and on wall time on a GPU.
Compile time is outside the rounds (two warm-up steps each).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.append(str(ROOT))

from adacc_hf import measure_step_peak, prepare  # noqa: E402
from adacc_hf.solver.step import extreme_peaks  # noqa: E402
from benchmarks.harness.models import find_specs  # noqa: E402
from benchmarks.harness.patching import hf_enable  # noqa: E402
from benchmarks.harness.stats import bootstrap, verdict  # noqa: E402
from benchmarks.harness.steps import optimizer_with_states  # noqa: E402

MiB = 2**20
KW = dict(adaptive=False, codecs=[], offload=False)
COMPILE_FRACTIONS = (1.0, 0.5, 0.25, 0.0)  # what a user would try, in order


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _step(call, batch, opt) -> tuple[float, float]:
    """(wall, process CPU) seconds of one step."""
    _sync()
    t0, c0 = time.perf_counter(), time.process_time()
    call(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync()
    return time.perf_counter() - t0, time.process_time() - c0


def _compile_budget(base, batch, budget: int) -> tuple[tuple | None, dict[float, int]]:
    """``torch.compile`` with AOTAutograd's ``activation_memory_budget``: the first of
    `COMPILE_FRACTIONS` whose measured step peak fits `budget` (a user's scan), as (call, model,
    optimizer, fraction), and every peak tried. The knob is read when a graph compiles, so each
    fraction starts from an empty compile cache and the chosen graph is compiled before the
    other ways (which then compile under the default, 1)."""
    import torch._functorch.config as functorch_config

    default = functorch_config.activation_memory_budget
    tried: dict[float, int] = {}
    try:
        for fraction in COMPILE_FRACTIONS:
            torch._dynamo.reset()
            functorch_config.activation_memory_budget = fraction
            model = copy.deepcopy(base)
            opt = optimizer_with_states(model)
            call = torch.compile(model)
            _step(call, batch, opt)
            measure_step_peak(call, batch, opt)
            tried[fraction] = measure_step_peak(call, batch, opt).peak_nbytes
            if tried[fraction] <= budget:
                return (call, model, opt, fraction), tried
    finally:
        functorch_config.activation_memory_budget = default
    return None, tried


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-cpu")
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3, help="timed steps per way per round")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 weights there)")
    p.add_argument("--batch", type=int, default=None, help="micro-batch (default: the model's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    (spec,) = find_specs("cpu", [args.model])
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base, _ = spec.build(device, dtype)
    base.train()
    batch_size = args.batch or spec.main_batch
    batch = spec.batch(base, batch_size)
    res: dict = {
        "model": spec.name,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype),
        "batch": [batch_size, spec.seq_len],
        "fraction": args.fraction,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "command": "python benchmarks/compiled.py " + " ".join(argv or sys.argv[1:]),
    }

    def log(msg: str) -> None:
        print(msg, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=1) + "\n")

    probe = copy.deepcopy(base)
    s = prepare(probe, "100GiB", batch, optimizer="adamw_torch", **KW)
    lo, hi = extreme_peaks(s.profile, s.ctx.static_memory(), 1, "full")
    s.close()
    budget = int(lo.peak_nbytes + args.fraction * (hi.peak_nbytes - lo.peak_nbytes))
    res["budget_nbytes"] = budget
    log(f"budget {budget / MiB:.1f} MiB ({args.fraction:g} of the way)")

    ways: dict[str, tuple] = {}
    chosen, tried = _compile_budget(base, batch, budget)
    res["compile_budget_tried"] = {f"{f:g}": peak for f, peak in tried.items()}
    if chosen is not None:  # compiled first, under its fraction; the others under the default
        ways["compile_budget"] = chosen[:3]
        res["compile_budget_fraction"] = chosen[3]
    log(f"compile budget: peaks by fraction {res['compile_budget_tried']}")
    hf = copy.deepcopy(base)
    hf_enable(hf, offload=False)
    ways["hf_full_compiled"] = (torch.compile(hf), hf, optimizer_with_states(hf))
    sessions = []
    for name, compiled in (("adacc_compiled", True), ("adacc_eager", False)):
        m = copy.deepcopy(base)
        o = optimizer_with_states(m)
        kw = {**KW, "compile": "inductor"} if compiled else KW
        sessions.append(prepare(m, budget, batch, optimizer=o, **kw))
        ways[name] = (torch.compile(m) if compiled else m, m, o)
    for name, session in zip(("adacc_compiled", "adacc_eager"), sessions, strict=True):
        policy = session.handle.policy  # each session plans for itself (timings may differ)
        res[f"{name}_policy"] = policy.summary()
        res[f"{name}_predicted_nbytes"] = policy.metadata.get("predicted", {}).get("peak_nbytes")
        res[f"{name}_profile_s"] = round(session.profile.profile_ms / 1e3, 1)
        res[f"{name}_profile_phases_ms"] = session.profile.phase_ms
    res["adacc_compiled_measured_parts"] = sessions[0].profile.compiled
    res["peaks"], res["compile_s"] = {}, {}
    for name, (call, _, opt) in ways.items():
        t0 = time.perf_counter()
        _step(call, batch, opt)
        res["compile_s"][name] = round(time.perf_counter() - t0, 1)
        measure_step_peak(call, batch, opt)
        measured = measure_step_peak(call, batch, opt)
        peak = measured.peak_nbytes
        res["peaks"][name] = {"peak_nbytes": peak, "fits": peak <= budget}
        if device.type == "cuda":  # the caching allocator's reserve beside the allocated peak
            res["peaks"][name]["reserved_peak_nbytes"] = measured.reserved_peak_nbytes
        log(f"{name}: first step {res['compile_s'][name]} s, peak {peak / MiB:.1f} MiB")
    walls: dict[str, list[float]] = {n: [] for n in ways}
    cpus: dict[str, list[float]] = {n: [] for n in ways}
    order = random.Random(0)
    for _ in range(args.rounds):
        for name in order.sample(list(ways), len(ways)):
            call, _, opt = ways[name]
            _step(call, batch, opt)  # what the previous way left in caches and the allocator
            took = [_step(call, batch, opt) for _ in range(args.steps)]
            walls[name].append(statistics.median(w for w, _ in took))
            cpus[name].append(statistics.median(c for _, c in took))
    times = cpus if device.type == "cpu" else walls
    res["clock"] = "process CPU" if device.type == "cpu" else "wall"
    med = {n: statistics.median(t) for n, t in times.items()}
    res["step_s_median"] = med
    res["step_s_all"] = times  # each round's median, on `clock`
    res["wall_s_all"] = walls
    res["ratios"], res["verdicts"] = {}, {}
    bars = [("hf_full_compiled", 0.98), ("adacc_eager", 1.0), ("compile_budget", 1.0)]
    for other, bar in [(o, b) for o, b in bars if o in ways]:
        # paired per round: the other way's step time over compiled Adacc's (> 1: Adacc faster)
        paired = [a / b for a, b in zip(times[other], times["adacc_compiled"], strict=True)]
        lo, hi = bootstrap(paired)
        key = f"adacc_compiled_vs_{other}"
        res["ratios"][key] = statistics.median(paired)
        res["verdicts"][key] = {"interval": [lo, hi], "bar": bar, "verdict": verdict(lo, hi, bar)}
    log(f"median step s: {med}; speed ratios: {res['ratios']}; verdicts: {res['verdicts']}")
    for s in sessions:
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
