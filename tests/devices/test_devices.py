"""Planning for a GPU this machine does not have: a step run without its arithmetic allocates what
the real step allocates, its ops are priced as torch counts them, the clock replays, a fit finds
the efficiencies that made the times it is given, and the plan and the command line come out.

The truth for memory is the real step on this CPU (torch.profiler's allocator events and the
storages alive after forward), for FLOPs torch's own flop counter, for the fit a clock whose
efficiencies the test chose. How the paper model holds up against what the GPUs measured is the
slow test at the end (and ``benchmarks/device_check.py``).
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from adacc_hf import apply_adacc, measure_step_peak, uniform_policy
from adacc_hf.assets import tiny_config
from adacc_hf.cli import main as cli
from adacc_hf.devices.calibrate import Outcome, Run, Setting, fit
from adacc_hf.devices.dryrun import dry_run, replay
from adacc_hf.devices.plan import empty_model, model_step, plan_for_device, random_batch
from adacc_hf.devices.roofline import Roofline, attention_flops, op_flops
from adacc_hf.devices.table import DeviceTable, known_devices, load_device
from adacc_hf.runtime.memory import activation_memory_report
from adacc_hf.solver.explain import REASONS, not_compressed


def _tiny(dtype=torch.float32, seed: int = 0):
    """A small LLaMA with GQA and attention dropout (CPU dropout fills noise in place), real
    weights, and a batch large enough that its activations take the dry path."""
    config = tiny_config("llama", hidden_size=64, intermediate_size=128, num_key_value_heads=2)
    config.use_cache = False
    torch.manual_seed(seed)
    model = type(empty_model(config)).__mro__[0](config).to(dtype).train()
    return model, random_batch(config, 2, 128)


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-5)


@pytest.mark.parametrize("strategy", ["none", "hf_full", "retain", "compress", "chunked"])
def test_a_dry_step_allocates_what_the_real_step_allocates(strategy):
    """The step's peak (allocator events) and what each block holds for backward (storages
    alive), to the byte, real and dry, under every kind of plan."""
    model, batch = _tiny()
    policy = None
    if strategy in ("retain", "compress", "chunked"):
        policy = uniform_policy(model, "retain" if strategy == "chunked" else strategy, batch)
        policy.head = "chunked" if strategy == "chunked" else "full"
    if strategy == "hf_full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def measure():
        opt = _opt(model)
        handle = apply_adacc(model, policy) if policy is not None else None
        try:
            model_step_real(model, batch, opt)
            peak = measure_step_peak(model, batch, opt)
            held = activation_memory_report(model, batch)
        finally:
            if handle is not None:
                handle.remove()
        return peak.peak_nbytes, peak.phases, held.blocks, held.other

    real = measure()
    with dry_run():
        dry = measure()
    assert dry[2:] == real[2:]  # what each block and the rest hold for backward
    # peaks: to the byte but for a few 0-dim temporaries a kernel allocates inside itself (the
    # optimizer's step counters, a codec's outlier count): at most 64 bytes
    assert abs(dry[0] - real[0]) <= 64
    assert all(abs(dry[1][k] - real[1][k]) <= 64 for k in real[1]), (dry[1], real[1])


def model_step_real(model, batch, opt) -> None:
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_a_dry_step_computes_no_floating_value():
    """A step whose activations need ~12 GiB runs dry in a process that never holds them:
    nothing floating is computed, so the pages are never touched."""
    code = """
import resource, torch
from adacc_hf.assets import tiny_config
from adacc_hf.devices.dryrun import dry_run
from adacc_hf.devices.plan import empty_model, random_batch
c = tiny_config("llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=8, vocab_size=256,
                attention_dropout=0.0)
c.use_cache = False
m = empty_model(c, torch.bfloat16)
b = random_batch(c, 8, 16384)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with dry_run():
    m(**b).loss.backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    grown_mib = int(out.stdout.strip().splitlines()[-1])
    assert grown_mib < 1024, out.stdout


def test_matmul_and_attention_flops_are_torchs():
    a, b = torch.randn(64, 32), torch.randn(32, 48)
    with FlopCounterMode(display=False) as fc:
        out = torch.mm(a, b)
    assert op_flops(torch.ops.aten.mm.default, (a, b), {}, out) == ("matmul", fc.get_total_flops())
    q, k = torch.randn(2, 4, 128, 16), torch.randn(2, 4, 128, 16)
    with FlopCounterMode(display=False) as fc:
        torch.matmul(torch.softmax(q @ k.transpose(-1, -2), -1), k)  # the math attention
    assert attention_flops(q, k, causal=False) == fc.get_total_flops()
    assert attention_flops(q, k, causal=True) == fc.get_total_flops() / 2


def test_replaying_a_steps_trace_gives_its_clock():
    table = load_device("h200")
    model, batch = _tiny(torch.bfloat16)
    with dry_run(Roofline(table)) as mode:
        step = model_step(mode, "none", model, batch, _opt(model))
    assert math.isclose(replay(step.trace, table, table.efficiency) * 1e3, step.step_ms)


def test_the_fit_finds_efficiencies_that_give_the_times_it_was_shown():
    """Steps timed on a clock with efficiencies the test chose (the host slower, matmuls and
    memory less efficient than the defaults): the fit, started from the defaults, explains
    each within 2 %."""
    table = load_device("h200")
    secret = dict(table.efficiency, matmul=0.45, memory=0.6, host_op_us=14.0)
    s = Setting("tiny", "llama", (), 2, 128)
    outcomes = []
    for strategy in ("none", "hf_full"):
        for dtype in (torch.float32, torch.bfloat16):
            model, batch = _tiny(dtype)
            if strategy == "hf_full":
                model.gradient_checkpointing_enable({"use_reentrant": False})
            with dry_run(Roofline(table)) as mode:
                step = model_step(mode, strategy, model, batch, _opt(model))
            measured = replay(step.trace, table, secret) * 1e3
            run = Run(f"{strategy}/{dtype}", "h200", s, strategy, measured, None)
            outcomes.append(Outcome(run, step.step_ms, step.peak_nbytes, trace=step.trace))
    start = DeviceTable.from_json(table.to_json())
    start.efficiency = {k: v for k, v in start.efficiency.items()}
    eff, worst = fit(start, outcomes)
    assert worst <= 0.02, (eff, worst)


def test_a_plan_made_on_paper_holds_its_budget_and_its_prediction():
    """The plan for an H200, solved from the dry profile: its dry step peaks where it predicts,
    within the budget."""
    model, batch = _tiny(torch.bfloat16)
    p = plan_for_device(model, batch, "h200", fraction=0.3)
    adacc = p.steps["adacc"]
    assert p.policy is not None and adacc.peak_nbytes <= p.budget_nbytes
    assert abs(p.predicted_peak_nbytes - adacc.peak_nbytes) <= 0.01 * adacc.peak_nbytes
    assert p.steps["none"].peak_nbytes > p.budget_nbytes >= p.steps["hf_full"].peak_nbytes
    assert p.profile.device.startswith("cuda (NVIDIA H200, modelled)")
    why = not_compressed(p.profile, p.policy)["block"]
    compressed = {k for v in p.policy.groups["block"].variants for k, a in v.actions.items()
                  if a.kind == "compress"}  # fmt: skip
    assert set(why.values()) <= set(REASONS) and not compressed & set(why)


def test_codecs_are_priced_from_the_table_or_at_a_fraction_of_a_copy():
    table = load_device("h200")
    mb = 64 * 2**20
    assert Roofline(table).codec_ms("int4_naive", "triton", mb, mb // 4) == table.codec_ms(
        "int4_naive", "triton", mb
    )
    enc, dec = Roofline(table, codec_speed=0.5).codec_ms("int4_naive", "modelled", mb, mb // 4)
    expected = (mb + mb // 4) / (0.5 * table.copy_gbps_at(mb) * 1e9) * 1e3
    assert math.isclose(enc, expected + table.efficiency["launch_us"] * 1e-3) and enc == dec


def test_the_committed_tables_name_their_sources_and_calibration():
    assert {"h100", "h200"} <= set(known_devices())
    for name in ("h100", "h200"):
        t = load_device(name)
        assert t.sources and t.calibrated_on and t.codecs["fp8_e4m3"]["triton"]
        assert t.copy_gbps_at(256 * 2**20) == pytest.approx(t.copy_peak_gbps, rel=1e-9)


def test_the_command_line_plans_for_a_gpu_on_paper(capsys):
    rc = cli(
        ["plan", "--config", "tiny-llama", "--device", "h200", "--fraction", "0.3",
         "--batch-size", "2", "--seq-len", "64", "--dtype", "bf16"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "x HF full checkpointing's speed" in out and "not compressed" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--fraction", "0.3", "--budget", "1GiB"], "exactly one of --budget or --fraction"),
        (["--budget", "auto"], "live device"),
        (["--budget", "20GiB", "--config", "nonesuch"], "unknown --config"),
    ],
)
def test_bad_input_to_a_paper_plan_says_what_to_change(argv, message, capsys):
    base = ["plan", "--device", "h200", "--batch-size", "2", "--seq-len", "64"]
    if "--config" not in argv:
        base += ["--config", "tiny-llama"]
    assert cli(base + argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("fit_on, check", [("h200", "h100"), ("h100", "h200")])
def test_plans_on_paper_meet_what_the_other_gpu_measured(fit_on, check):
    """Fitted on one GPU's committed runs, the other GPU's every committed step time within
    10 % and allocated peak within 2 % (the peak of SmolLM2 at 16k tokens without offload is
    the one known miss: see docs/results.md)."""
    sys.path.append(str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from benchmarks.device_check import direction

    res = direction(fit_on, check)
    assert res["time_bar_holds"], res["rows"]
    misses = [r for r in res["rows"] if r["peak_error"] is not None and abs(r["peak_error"]) > 0.02]
    assert [r["run"] for r in misses] in ([], ["h200/offload/adacc_no_offload"]), misses


@pytest.mark.slow  # 45 s
def test_a_paper_plan_keeps_free_what_cudas_allocator_would_reserve_above_it():
    """Under the default caching allocator the dry step's allocations, replayed through its model
    (`devices.caching_allocator`), reserve well above the allocated peak (the H200 reserved 25 %
    above what HF full allocated on SmolLM2's config): the paper plan is solved again with that
    kept free until its reserved peak fits the budget; expandable segments reserve less."""
    config = tiny_config(
        "llama", hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
    )  # fmt: skip
    config.use_cache = False
    plans = {}
    for expandable in (False, True):
        model, batch = empty_model(config), random_batch(config, 2, 1024)
        plans[expandable] = plan_for_device(
            model, batch, "h200", fraction=0.5, expandable=expandable
        )
    default, expandable = plans[False], plans[True]
    for p in plans.values():
        a = p.steps["adacc"]
        assert a.peak_nbytes <= a.reserved_nbytes <= p.budget_nbytes
        assert a.peak_nbytes <= p.budget_nbytes - p.reserve_nbytes
    full = {k: p.steps["hf_full"] for k, p in plans.items()}
    assert full[True].peak_nbytes == full[False].peak_nbytes
    assert full[False].reserved_nbytes > full[True].reserved_nbytes > full[True].peak_nbytes
    assert default.reserve_nbytes > 0  # the first plan did not fit what the allocator holds
