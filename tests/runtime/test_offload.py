"""Offload, the fourth action, against independent truth: unpatched gradients (bitwise), the
compress action's own numbers for offload-with-a-codec, step peaks measured by the CPU meter (the
stand-in host's buffers live outside torch's allocator, as pinned host memory lives off a GPU),
host syncs counted by a dispatch mode, and the solver's choices over given links."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from conftest import grad_rel_error, smollm2_on_text, step
from sync_count import SyncCounter
from test_solver import group as sgroup
from test_solver import op as sop
from test_solver import profile as sprofile

from adacc_hf import apply_adacc, assets, measure_step_peak, prepare, profile_model, trace_model
from adacc_hf.errors import BudgetError, PolicyError
from adacc_hf.policy import builders
from adacc_hf.runtime.offload import measure_link
from adacc_hf.schema import Action, OffloadLink, Profile, Variant, codec_candidates
from adacc_hf.solver import estimate_static_memory, solve
from adacc_hf.solver.cost_model import block_loads, predict
from adacc_hf.solver.offload import INPUT, exposed_ms
from adacc_hf.solver.step import extreme_peaks

#: Links the solver is tested over: an H100's PCIe 5 (about 55 GB/s each way, measured pinned
#: copies) and a GH200-class NVLink-C2C host link (about 450 GB/s), copies on a side stream.
PCIE5 = OffloadLink(55.0, 55.0, overlap=True, launch_ms=0.005)
GH200 = OffloadLink(450.0, 450.0, overlap=True, launch_ms=0.005)


def _offloading(trace, how: str):
    """Every output autograd saves offloaded (``how``: "raw" as it is; "codec" encoded with its
    layer type's codec, masks bit-packed; "compress": the same codecs kept on the device) and,
    but for "compress", every block's input."""
    pick = builders.codec_picker()

    def choose(op):
        if not op.saved:
            return Action.recompute()
        if how == "raw":
            return Action.offload()
        chosen = pick(op)
        if chosen.kind != "compress":
            return Action.offload() if how == "codec" else chosen
        if how == "codec":
            return Action.offload(chosen.codec, **dict(chosen.params))
        return chosen

    return builders.from_trace(trace, choose, source=f"test:{how}", offload_input=how != "compress")


def _same(a, b) -> bool:
    return (
        torch.equal(a[0], b[0])
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    )


def test_offload_gives_bitwise_equal_loss_and_gradients(tiny):
    """Every saved output and every block input parked in host memory: the same numbers as the
    unpatched model, step after step, and the host buffers are reused (the pool does not grow)."""
    model, batch = tiny
    ref = step(model, batch)
    policy = _offloading(trace_model(model, batch), "raw")
    with apply_adacc(model, policy) as handle:
        first = step(model, batch)
        made = handle.host.pool.held_nbytes
        second = step(model, batch)
        assert not handle.problems and not handle.unknown_ops
        host = handle.host
    assert _same(first, ref) and _same(second, ref)
    assert host.peak_host_nbytes > 0 and host.host_nbytes == 0  # everything came back
    assert host.pool.held_nbytes == made  # the second step reused the first's buffers


def test_offload_with_a_codec_is_compression_moved_off_the_device(tiny):
    """``offload:<codec>`` gives exactly the gradients ``compress:<codec>`` gives (the host
    round trip changes no bit), so it keeps the codec's fidelity bound; bit-packed masks and raw
    outputs alone are lossless: those policies match the unpatched model."""
    model, batch = tiny
    trace = trace_model(model, batch)
    with apply_adacc(model, _offloading(trace, "compress")):
        compressed = step(model, batch)
    with apply_adacc(model, _offloading(trace, "codec")):
        offloaded = step(model, batch)
    assert _same(offloaded, compressed)

    def lossless(op):  # masks bit-packed and parked, everything else saved parked raw
        if not op.saved:
            return Action.recompute()
        return (
            Action.offload("bitpack") if codec_candidates(op) == ["bitpack"] else Action.offload()
        )

    ref = step(model, batch)
    with apply_adacc(model, builders.from_trace(trace, lossless, source="t")):
        assert _same(step(model, batch), ref)


@pytest.mark.slow
def test_pretrained_smollm2_on_real_text():
    """The shipped pretrained SmolLM2-135M on Shakespeare (4 x 128): everything offloaded as it
    is gives the unpatched gradients bit for bit; offloaded with the codecs gives exactly what
    compressing with them gives, within the fidelity bar of `tests/codecs/test_fidelity.py`."""
    from test_fidelity import WHOLE_MODEL_BOUND

    model, batch = smollm2_on_text()
    ref = step(model, batch)
    trace = trace_model(model, batch)
    runs = {}
    for how in ("raw", "codec", "compress"):
        with apply_adacc(model, _offloading(trace, how)) as handle:
            runs[how] = step(model, batch)
            assert not handle.problems
    assert _same(runs["raw"], ref)
    assert _same(runs["codec"], runs["compress"])
    assert grad_rel_error(runs["codec"][1], ref[1]) <= WHOLE_MODEL_BOUND


def test_offloaded_bytes_are_off_the_device_and_predicted_to_the_byte():
    """Full recomputation with every block input parked on the host: the step meter sees the
    inputs leave the device (the peak drops by what they held at the head's backward), and the
    step model predicts the measured peak to the byte (the floor policy's tables need no
    measuring)."""
    model = assets.tiny_model("llama", num_hidden_layers=4)
    batch = assets.tiny_batch("llama", model, batch_size=4, seq_len=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    static = estimate_static_memory(model, optimizer="adamw_torch")
    measure_step_peak(model, batch, opt)  # the optimizer's states exist
    prof = profile_model(model, batch, repeats=1)
    prof.offload = OffloadLink(10.0, 10.0, overlap=False)
    trace = trace_model(model, batch)
    full = builders.from_trace(trace, lambda op: Action.recompute(), source="full")
    inputs = builders.from_trace(
        trace, lambda op: Action.recompute(), source="inputs", offload_input=True
    )
    measured = {}
    for name, policy in (("full", full), ("inputs", inputs)):
        with apply_adacc(model, policy):
            measured[name] = measure_step_peak(model, batch, opt)
        assert measured[name].peak_nbytes == predict(prof, policy, static).peak_nbytes, name
    held = sum(g.num_blocks * g.input_nbytes for g in prof.groups.values())
    head = {n: m.phases["backward"] for n, m in measured.items()}
    assert head["inputs"] < head["full"]
    low, _ = extreme_peaks(prof, static)
    assert low.inputs_offloaded and low.peak_nbytes == measured["inputs"].peak_nbytes
    assert held > 0


def test_a_plan_with_offload_fits_its_budget_and_its_prediction(monkeypatch):
    """A session planning with offload at a budget 10 % of the way from full recomputation to
    none (where it may offload or not: the faster plan wins), and at one below full
    recomputation's least peak (only offloaded inputs reach it): the measured step is within the
    budget and within 5 % of the prediction. The link is priced as a fast one (1 TB/s in line),
    so offload competes with recompute (the CPU stand-in's real memcpy makes it dearer); the
    copies themselves run on the stand-in as always (prices steer choices, the meter sees the
    truth)."""
    from adacc_hf.engine import solving

    monkeypatch.setattr(
        solving, "measure_link", lambda device, cap=0: OffloadLink(1000.0, 1000.0, False, 0.0, cap)
    )
    torch.manual_seed(0)
    model = assets.tiny_model("llama", num_hidden_layers=8)
    batch = assets.tiny_batch("llama", model, batch_size=4, seq_len=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    measure_step_peak(model, batch, opt)
    static = estimate_static_memory(model, optimizer="adamw_torch")
    prof = profile_model(model, batch, repeats=1)
    low, high = extreme_peaks(prof, static)
    prof.offload = measure_link("cpu")
    low_off, _ = extreme_peaks(prof, static)
    assert low_off.inputs_offloaded and low_off.peak_nbytes < low.peak_nbytes
    ample = int(low.peak_nbytes + 0.1 * (high.peak_nbytes - low.peak_nbytes))
    tight = (low_off.peak_nbytes + low.peak_nbytes) // 2
    for budget in (ample, tight):
        s = prepare(model, budget, batch, adaptive=False, offload=True, optimizer=opt)
        policy = s.policy
        got = measure_step_peak(model, batch, opt).peak_nbytes
        s.close()
        predicted = policy.metadata["predicted"]["peak_nbytes"]
        assert got <= budget, (budget, got)
        assert abs(got - predicted) <= 0.05 * predicted, (budget, got, predicted)
        if budget == tight:  # only offload reaches below full recomputation's least peak
            assert any(v.offloads for g in policy.groups.values() for v in g.variants)


def test_offload_adds_no_host_syncs(tiny):
    model, batch = tiny
    with SyncCounter() as plain:
        step(model, batch)
    with apply_adacc(model, _offloading(trace_model(model, batch), "codec")):
        with SyncCounter() as first:
            step(model, batch)
        with SyncCounter() as ordinary:
            step(model, batch)
    assert first.ops == ordinary.ops == plain.ops


def long_context_profile(num_blocks: int = 8, seq: int = 8192, hidden: int = 576) -> Profile:
    """SmolLM2's block at 8k tokens (micro-batch 1, fused attention: nothing quadratic) with an
    H100's times: an elementwise pass over the hidden states at about 2 TB/s, projections at about
    50 TFLOP/s, flash attention's forward 4 s^2 h flops. One block's forward takes about 3 ms and
    saves about 460 MB: over PCIe 5 a third of it hides under the forward, over a GH200-class link
    all of it."""
    h, i = seq * hidden, seq * 1536
    pass_ms = h * 4 * 2 / 2e9  # read + write, 2 TB/s

    def mm_ms(n_out: int) -> float:
        return 2 * seq * hidden * n_out / 50e9

    allc = ("int4_outlier", "int4_channel")
    ops = [
        sop("input_layernorm/mul#1", "norm", h, pass_ms, allc),
        sop("self_attn.q_proj/mm#0", "qkv", h, mm_ms(hidden), allc),
        sop("self_attn.k_proj/mm#0", "qkv", h // 3, mm_ms(hidden // 3), allc),
        sop("self_attn.v_proj/mm#0", "qkv", h // 3, mm_ms(hidden // 3), allc),
        sop("self_attn/add#0", "qkv", h, pass_ms, allc),
        sop("self_attn/add#1", "qkv", h // 3, pass_ms / 3, allc),
        sop("self_attn/sdpa#0", "attn_fused", h, 4 * seq * seq * hidden / 100e9),
        sop("self_attn.o_proj/mm#0", "attn_out", h, mm_ms(hidden), allc),
        sop("/add#0", "elementwise", h, pass_ms, allc),
        sop("post_attention_layernorm/mul#1", "norm", h, pass_ms, allc),
        sop("mlp.gate_proj/mm#0", "mlp_up", i, mm_ms(1536), allc),
        sop("mlp.up_proj/mm#0", "mlp_up", i, mm_ms(1536), allc),
        sop("mlp.act_fn/silu#0", "act", i, pass_ms * 8 / 3, allc),
        sop("mlp/mul#0", "elementwise", i, pass_ms * 8 / 3, allc),
        sop("mlp.down_proj/mm#0", "mlp_down", h, mm_ms(1536), allc),
        sop("/add#1", "elementwise", h, pass_ms, block_output=True),
    ]
    g = sgroup("layers", num_blocks, ops, x_numel=h, fixed_ms=3 * pass_ms)
    return sprofile([g], nonblock=4 * h * 4)


LONG_STATIC = 2 * 2**30  # parameters, gradients and AdamW states of a 135M model


@pytest.mark.parametrize("share", [0.1, 0.3])
def test_the_solver_weighs_offload_by_the_link(share):
    """Over a GH200-class link the solver parks more than over PCIe 5 at the same budget (over
    PCIe only what hides under the blocks' compute) and its plan is no slower; both beat the plan
    without offload; each plan's predicted step is within the budget and priced as `predict`
    prices it."""
    prof = long_context_profile()
    low, high = extreme_peaks(prof, LONG_STATIC)
    budget = int(low.peak_nbytes + share * (high.peak_nbytes - low.peak_nbytes))
    sols, parked = {}, {}
    for name, link in (("none", None), ("pcie5", PCIE5), ("gh200", GH200)):
        p = replace(prof, offload=link)
        sol = solve(p, budget, static_nbytes=LONG_STATIC)
        pred = predict(p, sol.policy, LONG_STATIC, measured_ms=False)
        assert sol.status == "optimal" and sol.peak_nbytes <= budget
        assert pred.peak_nbytes == sol.peak_nbytes and pred.added_ms == pytest.approx(sol.added_ms)
        sols[name], parked[name] = sol, _parked(p, sol.policy)
    assert parked["none"] == 0 and 0 < parked["pcie5"] <= parked["gh200"]
    assert sols["gh200"].added_ms <= sols["pcie5"].added_ms < sols["none"].added_ms
    # over PCIe it parks what hides under the blocks' compute, less than over the fast link
    g = prof.groups["layers"]
    assert parked["pcie5"] < parked["gh200"]
    assert exposed_ms(PCIE5, g, parked["pcie5"] / g.num_blocks) <= 0.1 * g.block_fwd_ms


def test_below_full_recomputation_only_offload_fits():
    """At a budget under full recomputation's least step peak (the long-context case), the solver
    without a link refuses, and with either link plans a step within it by parking block inputs."""
    prof = long_context_profile()
    low, _ = extreme_peaks(prof, LONG_STATIC)
    low_off, _ = extreme_peaks(replace(prof, offload=PCIE5), LONG_STATIC)
    assert low_off.inputs_offloaded and low_off.peak_nbytes < low.peak_nbytes
    budget = (low.peak_nbytes + low_off.peak_nbytes) // 2
    with pytest.raises(BudgetError):
        solve(prof, budget, static_nbytes=LONG_STATIC)
    for link in (PCIE5, GH200):
        p = replace(prof, offload=link)
        sol = solve(p, budget, static_nbytes=LONG_STATIC)
        assert sol.peak_nbytes <= budget
        assert any(v.offload_input for g in sol.policy.groups.values() for v in g.variants)


def _parked(prof, policy) -> int:
    """Bytes the policy parks on the host in one step (every block's offloaded outputs and
    inputs at their profiled sizes)."""
    loads, _, _ = block_loads(prof, policy, measured_ms=False)
    return sum(b.parked for bl in loads.values() for b in bl)


def test_the_solver_keeps_the_host_cap():
    prof = replace(long_context_profile(), offload=GH200)
    low, high = extreme_peaks(prof, LONG_STATIC)
    budget = int(low.peak_nbytes + 0.3 * (high.peak_nbytes - low.peak_nbytes))
    free = _parked(prof, solve(prof, budget, static_nbytes=LONG_STATIC).policy)
    capped = replace(prof, offload=replace(GH200, host_cap_nbytes=free // 3))
    sol = solve(capped, budget, static_nbytes=LONG_STATIC)
    assert 0 < _parked(capped, sol.policy) <= free // 3
    assert sol.peak_nbytes <= budget


def test_a_full_host_keeps_tensors_on_the_device_and_gradients_exact(caplog):
    model = assets.tiny_model("llama")
    batch = assets.tiny_batch("llama", model)
    ref = step(model, batch)
    policy = _offloading(trace_model(model, batch), "raw")
    with (
        caplog.at_level(logging.WARNING, logger="adacc_hf"),
        apply_adacc(model, policy, host_cap=4096) as handle,
    ):
        got = step(model, batch)
        assert handle.host.refused > 0 and handle.host.pool.held_nbytes <= 4096
    assert _same(got, ref)
    assert "host memory cap" in caplog.text


def test_offload_actions_read_and_write_as_json():
    v = Variant(
        2,
        True,
        {"a": Action.offload(), "b": Action.offload("int4_outlier", zscore_threshold=3.0)},
        offload_input=True,
    )
    back = Variant.from_json(v.to_json())
    assert back == v and back.fingerprint() == v.fingerprint() and back.offloads
    assert str(v.actions["b"]) == "offload:int4_outlier(zscore_threshold=3.0)"
    assert v.fingerprint() != replace(v, offload_input=False).fingerprint()
    with pytest.raises(PolicyError):
        Action("retain", "int4_outlier")
    assert INPUT not in v.actions
