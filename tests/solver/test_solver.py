"""The policy solver: budgets, the static memory model, and the MILP's optimality on synthetic
profiles (checked against exhaustive search under the same cost model)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import numpy as np
import pulp
import pytest
import torch
from torch import nn

from adacc_hf import assets
from adacc_hf.errors import BudgetError
from adacc_hf.policy import Policy
from adacc_hf.schema import CodecProfile, GroupProfile, OpProfile, Profile
from adacc_hf.solver import budget as budget_mod
from adacc_hf.solver import (
    describe_budget,
    estimate_static_memory,
    measured_static_memory,
    min_budget,
    no_checkpoint_budget,
    parse_budget,
    predict,
    solve,
    solve_policy,
)
from adacc_hf.units import GiB, MiB, fmt_bytes

F32 = "torch.float32"
CODECS = {  # name -> (compression ratio, encode+decode ms per MiB of input, relative error)
    "int4_outlier": (3.6, 0.030, 0.09),
    "int4_channel": (4.4, 0.018, 0.12),
    "int4_asym": (4.1, 0.015, 0.10),
    "int4_naive": (4.5, 0.010, 0.80),  # cheapest and smallest, but far too lossy
}


def op(key, layer_type, numel, fwd_ms, codecs=(), *, cacheable=True, block_output=False):
    nbytes = numel * 4
    cps = {}
    for name in codecs:
        ratio, ms_per_mib, err = CODECS[name]
        params = {"zscore_threshold": 3.0} if name == "int4_outlier" else {}
        ms = ms_per_mib * nbytes / MiB
        cps[name] = CodecProfile(name, params, int(nbytes / ratio), ms * 0.55, ms * 0.45, err)
    return OpProfile(
        key=key,
        layer_type=layer_type,
        shape=(numel // 64, 64),
        dtype=F32,
        nbytes=nbytes,
        saved=True,
        cacheable=cacheable,
        fwd_ms=fwd_ms,
        block_output=block_output,
        shared_nbytes=nbytes if block_output else 0,
        codecs=cps,
    )


def group(name, num_blocks, ops, *, x_numel, fixed_ms, transient_x=2.0):
    x = x_numel * 4
    full = x + sum(o.nbytes for o in ops if not o.block_output)
    return GroupProfile(
        name=name,
        num_blocks=num_blocks,
        input_nbytes=x,
        full_nbytes=full,
        fixed_ms=fixed_ms,
        transient_nbytes=int(transient_x * x),
        block_fwd_ms=fixed_ms + sum(o.fwd_ms for o in ops),
        ops=ops,
    )


def profile(groups, nonblock=3 * MiB):
    return Profile(
        model_type="llama",
        adapter="llama",
        adapter_version=1,
        device="cpu",
        dtype=F32,
        batch_shape={"input_ids": [2, 512]},
        groups={g.name: g for g in groups},
        nonblock_nbytes=nonblock,
    )


def llama_profile(num_blocks=8, seq=1024, hidden=512):
    """A llama-like block: ~25 ops, outputs sized like the real ones (batch 1)."""
    h, i4, heads = seq * hidden, 4 * seq * hidden, 8
    s = heads * seq * seq
    ms = h / 2**18  # ~ms for one hidden-sized elementwise pass on a slow device
    allc = ("int4_outlier", "int4_channel", "int4_asym", "int4_naive")
    ops = [
        op("input_layernorm/pow#0", "norm", h, 0.3 * ms, allc),
        op("input_layernorm/mean#0", "norm", seq, 0.2 * ms),
        op("input_layernorm/rsqrt#0", "norm", seq, 0.05 * ms),
        op("input_layernorm/mul#0", "norm", h, 0.3 * ms, allc),
        op("input_layernorm/mul#1", "norm", h, 0.3 * ms, allc),
        op("self_attn.q_proj/mm#0", "qkv", h, 6 * ms, allc),
        op("self_attn.k_proj/mm#0", "qkv", h, 6 * ms, allc),
        op("self_attn.v_proj/mm#0", "qkv", h, 6 * ms, allc),
        op("self_attn/mul#0", "qkv", h, 0.4 * ms, allc),
        op("self_attn/add#0", "qkv", h, 0.4 * ms, allc),
        op("self_attn/bmm#0", "attn_scores", s, 3 * ms, allc),
        op("self_attn/_softmax#0", "attn_probs", s, 2.5 * ms, ("int4_asym", "int4_naive")),
        op("self_attn/native_dropout#0", "attn_dropout", s, 2 * ms, cacheable=False),
        op("self_attn/bmm#1", "attn_context", h, 3 * ms, allc),
        op("self_attn.o_proj/mm#0", "attn_out", h, 6 * ms, allc),
        op("/add#0", "elementwise", h, 0.3 * ms, allc),
        op("post_attention_layernorm/pow#0", "norm", h, 0.3 * ms, allc),
        op("post_attention_layernorm/mul#0", "norm", h, 0.3 * ms, allc),
        op("post_attention_layernorm/mul#1", "norm", h, 0.3 * ms, allc),
        op("mlp.gate_proj/mm#0", "mlp_up", i4, 20 * ms, allc),
        op("mlp.up_proj/mm#0", "mlp_up", i4, 20 * ms, allc),
        op("mlp.act_fn/silu#0", "act", i4, 1.2 * ms, allc),
        op("mlp/mul#0", "elementwise", i4, 1.2 * ms, allc),
        op("mlp.down_proj/mm#0", "mlp_down", h, 20 * ms, allc),
        op("/add#1", "elementwise", h, 0.3 * ms, block_output=True),
    ]
    return profile([group("layers", num_blocks, ops, x_numel=h, fixed_ms=2.2 * ms)])


def small_ops(prefix, rng, n_ops, codecs=("int4_asym", "int4_channel")):
    out = []
    for i in range(n_ops):
        numel = 64 * rng.choice([1024, 2048, 4096, 8192])
        out.append(op(f"{prefix}/op#{i}", "qkv", numel, round(rng.uniform(0.02, 0.4), 3), codecs))
        # vary codec timings so some compress actions win and others are dominated
        for cp in out[-1].codecs.values():
            cp.encode_ms = round(rng.uniform(0.005, 0.2), 3)
            cp.decode_ms = round(rng.uniform(0.005, 0.1), 3)
    return out


# ------------------------------------------------------------------ exhaustive search
ACTIONS = ("retain", "compress:int4_asym", "compress:int4_channel", "recompute")


def block_options(g: GroupProfile, consistent: bool = False, max_grad_error: float | None = None):
    """(ms, bytes, checkpointed) of every per-block assignment: no checkpoint, or a per-op tuple.
    ``consistent``: only assignments where no attention op (``attn_fused``) is kept after a
    lossily compressed op nor compressed itself (written out here, independently of
    `adacc_hf.policy.consistency`). ``max_grad_error``: only assignments whose compressed ops'
    ``grad_error`` add up in quadrature to at most it."""
    rows = [(0.0, g.full_nbytes, False)]
    costs = []
    for o in g.ops:
        c = [(0.0, o.retain_nbytes, "retain", 0.0)]
        c += [
            (o.codecs[n].ms, o.codecs[n].nbytes, "lossy", o.codecs[n].grad_error or 0.0)
            for n in ("int4_asym", "int4_channel")
        ]
        c.append((o.fwd_ms, 0, "recompute", 0.0))
        costs.append(c)
    for combo in itertools.product(*costs):
        if max_grad_error is not None and math.fsum(e * e for *_, e in combo) > max_grad_error**2:
            continue
        if consistent:
            kinds = [k for _, _, k, _ in combo]
            stat = [o.layer_type == "attn_fused" for o in g.ops]
            if any(
                s and (k == "lossy" or (k == "retain" and "lossy" in kinds[:i]))
                for i, (s, k) in enumerate(zip(stat, kinds, strict=True))
            ):
                continue
        rows.append(
            (
                g.fixed_ms + math.fsum(t for t, *_ in combo),
                g.input_nbytes + sum(m for _, m, *_ in combo),
                True,
            )
        )
    return (
        np.array([r[0] for r in rows]),
        np.array([r[1] for r in rows]),
        np.array([r[2] for r in rows]),
    )


def exhaustive(
    prof: Profile,
    static: int,
    split: bool,
    consistent: bool = False,
    max_grad_error: float | None = None,
):
    """Per configuration of all blocks: (total ms, step peak), over every assignment.

    The peak follows `solver.step`'s moments for these synthetic profiles (no gradients, nothing
    held before the blocks, no head / loss transients): the end of forward holds everything
    (``nonblock + sum h``); block j's backward starts with the blocks up to j still held and adds
    its transient (``sum_{i<=j} h_i + T_j``; a plain block's is 0). Groups run in order; inside a
    group the realised policy puts checkpointed blocks by ascending held, then the plain ones."""
    per_group = []  # per group: list of per-config option tuples (ms, [(held, T, ckpt)] in order)
    for g in prof.groups.values():
        t, m, ck = block_options(g, consistent, max_grad_error)
        opts = range(len(t))
        combos = (
            itertools.product(opts, repeat=g.num_blocks)
            if split
            else ((i,) * g.num_blocks for i in opts)
        )
        rows = []
        for combo in combos:
            blocks = [(int(m[i]), g.transient_nbytes if ck[i] else 0, bool(ck[i])) for i in combo]
            order = sorted(b for b in blocks if b[2]) + [b for b in blocks if not b[2]]
            rows.append((math.fsum(t[i] for i in combo), order))
        per_group.append(rows)
    total_ms, peaks = [], []
    for choice in itertools.product(*per_group):
        blocks = [b for _, order in choice for b in order]
        peak = prof.nonblock_nbytes + sum(h for h, _, _ in blocks)
        prefix = 0
        for h, tr, _ in blocks:
            prefix += h
            peak = max(peak, prefix + tr)
        total_ms.append(math.fsum(ms for ms, _ in choice))
        peaks.append(static + peak)
    return np.array(total_ms), np.array(peaks)


def best_time(ms, peak, budget):
    ok = peak <= budget
    return float(ms[ok].min()) if ok.any() else None


@pytest.fixture(scope="module")
def tiny_profile():
    rng = random.Random(7)
    ops = small_ops("layers", rng, 3)
    ops.append(dataclasses.replace(ops[2], key="layers/twin#0"))  # identical costs: merged
    g = group("layers", 2, ops, x_numel=64 * 1024, fixed_ms=0.05)
    return profile([g], nonblock=MiB)


@pytest.fixture(scope="module")
def two_group_profile():
    rng = random.Random(11)
    enc = group("encoder", 2, small_ops("enc", rng, 3), x_numel=64 * 1024, fixed_ms=0.04)
    dec = group(
        "decoder", 1, small_ops("dec", rng, 3), x_numel=64 * 2048, fixed_ms=0.07, transient_x=3
    )
    return profile([enc, dec], nonblock=2 * MiB)


@pytest.mark.parametrize("split", [True, False], ids=["split_blocks", "one_policy"])
@pytest.mark.parametrize("which", ["tiny_profile", "two_group_profile"])
def test_milp_objective_equals_exhaustive_optimum(request, which, split):
    prof = request.getfixturevalue(which)
    static = 5 * MiB
    ms, peak = exhaustive(prof, static, split)
    lo, hi = int(peak.min()), no_checkpoint_budget(prof, static)
    budgets = sorted({int(b) for b in np.linspace(lo, hi, 10)} | {lo, hi, hi - 1})
    seen_partial = False
    for b in budgets:
        sol = solve(
            prof, b, static_nbytes=static, split_blocks=split, max_rel_error=None, mip_gap=0
        )
        assert sol.min_budget_nbytes == lo
        assert sol.status in ("optimal", "fits")
        assert sol.added_ms == pytest.approx(best_time(ms, peak, b), abs=1e-6), b
        assert sol.peak_nbytes <= b
        seen_partial |= 0 < sol.added_ms < ms.max() and sol.status == "optimal"
        fast = solve(prof, b, static_nbytes=static, split_blocks=split, max_rel_error=None)
        assert sol.added_ms <= fast.added_ms <= sol.added_ms + fast.policy.metadata["gap_ms"]
    assert seen_partial  # the sweep exercised budgets strictly between the extremes


def test_split_blocks_is_never_slower_than_one_policy(two_group_profile):
    prof = two_group_profile
    lo = solve(prof, 10 * GiB).min_budget_nbytes
    hi = no_checkpoint_budget(prof)
    for b in np.linspace(lo, hi, 6).astype(int):
        split = solve(prof, int(b)).added_ms
        one = solve(prof, int(b), split_blocks=False).added_ms
        assert split <= one + 1e-9


# --------------------------------------------------------------------- llama sweep
@pytest.fixture(scope="module")
def llama():
    return llama_profile()


@pytest.fixture(scope="module")
def llama_sweep(llama):
    static = 300 * MiB
    lo = solve(llama, 100 * GiB, static_nbytes=static).min_budget_nbytes
    hi = no_checkpoint_budget(llama, static)
    budgets = [int(b) for b in np.linspace(lo, hi, 16)] + [hi, hi + GiB]
    return static, [(b, solve(llama, b, static_nbytes=static)) for b in budgets]


def test_added_time_never_grows_with_the_budget(llama_sweep, two_group_profile):
    _, sols = llama_sweep
    added = [s.added_ms for _, s in sols]
    gap = sols[0][1].policy.metadata["gap_ms"]  # the default mip_gap's tolerance
    assert 0 < gap < 1e-2 * added[0]
    assert all(b <= a + gap for a, b in itertools.pairwise(added))
    assert added[0] > added[len(added) // 2] > 0
    prof = two_group_profile  # proven optimal (mip_gap=0): exactly monotone
    lo, hi = solve(prof, GiB).min_budget_nbytes, no_checkpoint_budget(prof)
    exact = [solve(prof, int(b), mip_gap=0).added_ms for b in np.linspace(lo, hi, 12)]
    assert all(b <= a for a, b in itertools.pairwise(exact))


def test_enough_memory_means_no_checkpointing(llama_sweep):
    _, sols = llama_sweep
    for _, sol in sols[-2:]:
        assert sol.added_ms == 0
        assert all(k == 0 for k in sol.checkpointed.values())
        for g in sol.policy.groups.values():
            assert all(not v.checkpoint for v in g.variants)


def test_predicted_step_peak_stays_within_budget(llama_sweep):
    _, sols = llama_sweep
    for b, sol in sols:
        assert sol.peak_nbytes <= b and sol.moment


def test_policy_variants_realise_the_integer_counts(llama, llama_sweep):
    _, sols = llama_sweep
    mixed = 0
    for _, sol in sols:
        gp = sol.policy.groups["layers"]
        flags = [v.checkpoint for v in gp.variants]
        assert flags == sorted(flags, reverse=True)  # no-checkpoint blocks go last
        assert gp.num_blocks == 8 and gp.input_nbytes == llama.groups["layers"].input_nbytes
        assert [o.key for o in gp.ops] == [o.key for o in llama.groups["layers"].ops]
        for key, per_action in sol.counts["layers"].items():
            assert sum(per_action.values()) == sol.checkpointed["layers"]
            got: dict[str, int] = {}
            for v in gp.variants:
                if v.checkpoint:
                    label = str(v.action(key)).split("(")[0]
                    got[label] = got.get(label, 0) + v.count
            assert got == {a: c for a, c in per_action.items() if c}
        mixed += sum(v.checkpoint for v in gp.variants) > 1
        again = Policy.from_json(sol.policy.to_json())  # valid, serialisable
        assert again.fingerprint() == sol.policy.fingerprint()
    assert mixed  # some budget needs blocks with different action tables


def test_predict_counts_missing_ops_as_recompute(llama):
    g = llama.groups["layers"]
    sol = solve(llama, min_budget(llama))
    pred = predict(llama, sol.policy)
    recompute_ms = g.num_blocks * (g.fixed_ms + sum(o.fwd_ms for o in g.ops if o.cacheable))
    assert sol.status == "optimal"
    assert pred.held_nbytes == llama.full_recompute_nbytes()
    # At the least budget only full recomputation fits: the block output is not kept either (it
    # would stay alive until the block's backward).
    assert pred.added_ms == pytest.approx(recompute_ms)
    for v in sol.policy.groups["layers"].variants:
        v.actions.clear()  # no actions named: everything is recomputed
    assert predict(llama, sol.policy).added_ms == pytest.approx(recompute_ms)


# ------------------------------------------------------------------------ errors
def test_too_small_budget_names_the_smallest_feasible_one(llama):
    need = min_budget(llama, 1000)
    assert need > 1000 + llama.full_recompute_nbytes()
    assert solve(llama, need, static_nbytes=1000).status == "optimal"
    with pytest.raises(BudgetError, match="Activations dominate") as e:
        solve(llama, need - 1, static_nbytes=1000)
    assert fmt_bytes(need) in str(e.value) and str(need) in str(e.value)


def test_budget_dominated_by_static_memory_says_so(llama):
    static = estimate_static_memory(assets.tiny_model("llama"))
    static = dataclasses.replace(static, optimizer=50 * GiB)
    with pytest.raises(BudgetError, match="Static memory dominates") as e:
        solve(llama, "40GiB", static_nbytes=static)
    assert "8-bit" in str(e.value) and "exceeds the budget" in str(e.value)


@pytest.mark.parametrize(
    "bad", ["20 parsecs", "-5GiB", "0", "150%", "%", "", None, math.nan, "1e400GB", "1e308TiB"]
)
def test_malformed_budgets_are_rejected(llama, bad):
    with pytest.raises(BudgetError, match="accepted forms"):
        solve_policy(llama, bad)


@pytest.mark.parametrize("failure", ["raise", "not_solved"])
def test_solver_failure_falls_back_to_full_recompute(llama, monkeypatch, failure):
    def broken(self, solver=None, **kwargs):
        if failure == "raise":
            raise pulp.PulpSolverError("cbc crashed")
        return pulp.LpStatusNotSolved

    monkeypatch.setattr(pulp.LpProblem, "solve", broken)
    budget = llama.no_checkpoint_nbytes() // 2
    with pytest.warns(UserWarning, match="falling back to full recomputation"):
        sol = solve(llama, budget)
    assert sol.status == "fallback" and sol.policy.metadata["status"] == "fallback"
    (variant,) = sol.policy.groups["layers"].variants
    assert variant.checkpoint and variant.count == 8
    assert {a.kind for a in variant.actions.values()} == {"recompute"}
    assert sol.held_nbytes == llama.full_recompute_nbytes()


def test_highs_is_used_when_installed_else_cbc_with_a_warning(tiny_profile):
    b = (tiny_profile.full_recompute_nbytes() + tiny_profile.no_checkpoint_nbytes()) // 2
    ref = solve(tiny_profile, b)
    if pulp.HiGHS(msg=False).available():
        sol = solve(tiny_profile, b, solver="highs")
        assert sol.solver == "highs"
    else:
        with pytest.warns(UserWarning, match="HiGHS is not available"):
            sol = solve(tiny_profile, b, solver="highs")
        assert sol.solver == "cbc"
    assert sol.added_ms == pytest.approx(ref.added_ms, abs=1e-6)
    with pytest.raises(ValueError, match="unknown solver"):
        solve(tiny_profile, b, solver="gurobi")


# ----------------------------------------------------------------------- codecs
def _codecs_used(policy):
    return {
        a.codec
        for g in policy.groups.values()
        for v in g.variants
        for a in v.actions.values()
        if a.kind == "compress"
    }


def test_codec_filter_limits_the_codecs_used(llama):
    budget = (llama.full_recompute_nbytes() + llama.no_checkpoint_nbytes()) // 3
    assert _codecs_used(solve_policy(llama, budget)) - {"int4_channel"}
    only = solve_policy(llama, budget, codecs=["int4_channel"])
    assert _codecs_used(only) == {"int4_channel"}
    assert only.metadata["predicted"]["peak_nbytes"] <= budget


def test_max_rel_error_excludes_lossy_codecs(llama):
    budget = (llama.full_recompute_nbytes() + llama.no_checkpoint_nbytes()) // 3
    assert "int4_naive" in _codecs_used(solve_policy(llama, budget, max_rel_error=None))
    assert "int4_naive" not in _codecs_used(solve_policy(llama, budget))  # default 0.5
    assert _codecs_used(solve_policy(llama, budget, max_rel_error=0.095)) == {"int4_outlier"}


def test_unknown_codec_names_are_rejected(llama):
    with pytest.raises(ValueError, match="unknown codec"):
        solve_policy(llama, "1GiB", codecs=["int3_magic"])


def test_backward_temporary_outside_blocks_counts_in_the_peak(tiny_profile):
    prof = dataclasses.replace(tiny_profile, head_transient_nbytes=64 * MiB)
    floor = 64 * MiB
    fits = no_checkpoint_budget(prof)
    assert fits == prof.no_checkpoint_nbytes() + floor  # the head's backward sets the peak
    assert solve(prof, fits).status == "fits"
    sol = solve(prof, fits - 1)
    assert sol.status == "optimal" and sol.transient_nbytes >= floor
    assert sol.peak_nbytes <= fits - 1
    assert predict(prof, sol.policy).peak_nbytes == sol.peak_nbytes
    assert solve(prof, GiB).min_budget_nbytes >= prof.full_recompute_nbytes() + floor


def test_policy_metadata_records_the_solve(llama):
    policy = solve_policy(llama, "1GiB", static_nbytes=123)
    m = policy.metadata
    assert m["source"] == "milp" and m["solver"] == "cbc" and m["solve_ms"] > 0
    assert m["budget_nbytes"] == GiB and m["budget_spec"] == "1GiB" and m["static_nbytes"] == 123
    assert m["profile"] == {"device": "cpu", "dtype": F32, "batch_shape": {"input_ids": [2, 512]}}
    assert m["predicted"]["peak_nbytes"] <= GiB
    assert sum(r["count"] for r in m["predicted"]["groups"]["layers"]) == 8


# ----------------------------------------------------------------------- budgets
@pytest.mark.parametrize(
    ("spec", "nbytes"),
    [
        (123456, 123456),
        (2.5e9, 2_500_000_000),
        ("20GiB", 20 * GiB),
        ("20 GiB", 20 * GiB),
        ("20gib", 20 * GiB),
        ("512MiB", 512 * MiB),
        ("20GB", 20 * 10**9),
        ("1.5TB", 15 * 10**11),
        ("1000", 1000),
        ("80%", 80 * GiB),
        (" 12.5 % ", int(12.5 * GiB)),
        ("auto", 60 * GiB - 5 * GiB),
    ],
)
def test_budget_table(monkeypatch, spec, nbytes):
    monkeypatch.setattr(budget_mod, "device_memory", lambda device=None: (100 * GiB, 60 * GiB))
    assert parse_budget(spec, "cpu") == nbytes


def test_budget_accepts_numpy_ints_and_profile_device_names(monkeypatch):
    monkeypatch.setattr(budget_mod, "device_memory", lambda device=None: (100 * GiB, 60 * GiB))
    assert parse_budget(np.int64(4096)) == 4096
    assert parse_budget("50%", "cuda:0 (NVIDIA H100 80GB HBM3)") == 50 * GiB


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_share_without_a_gpu_says_what_to_do():
    with pytest.raises(BudgetError, match="cannot read the memory of cuda:0.*'20GiB'"):
        parse_budget("80%", "cuda:0")


def test_auto_budget_margin_is_at_least_one_gib(monkeypatch):
    monkeypatch.setattr(budget_mod, "device_memory", lambda device=None: (8 * GiB, 6 * GiB))
    assert parse_budget("auto", "cuda:0") == 5 * GiB
    how = describe_budget("auto", "cuda:0")
    assert "margin of 1.00 GiB" in how and "max(1 GiB, 5% of the 8.00 GiB total)" in how


@pytest.mark.parametrize("bad", ["20 parsecs", "-5GiB", "0", "150%", "%", "nan", None, math.nan])
def test_budget_errors_list_the_accepted_forms(bad):
    with pytest.raises(BudgetError, match="accepted forms") as e:
        parse_budget(bad, "cpu")
    assert "'20GiB'" in str(e.value) and "'auto'" in str(e.value)


def test_host_budgets_read_real_memory_without_touching_cuda():
    total = parse_budget("100%", "cpu")
    assert 0 < parse_budget("auto", "cpu") < total
    assert "total on cpu" in describe_budget("50%", "cpu")
    assert not torch.cuda.is_initialized()


# ------------------------------------------------------------------ static memory
def _one_step(model, make_optimizer, family="llama"):
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    model(**assets.tiny_batch(family, base)).loss.backward()
    opt.step()
    return opt


def _optimizers():
    from transformers.optimization import Adafactor

    out = {
        "adamw_torch": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
        "adafactor": lambda ps: Adafactor(ps),
    }

    def adamw_8bit(ps):
        bnb = pytest.importorskip("bitsandbytes")
        return bnb.optim.AdamW8bit(ps, lr=1e-3)

    out["adamw_bnb_8bit"] = adamw_8bit
    return out


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", list(_optimizers()))
def test_static_estimate_matches_measured_bytes(name, lora):
    model = assets.tiny_model("llama")
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    opt = _one_step(model, _optimizers()[name])
    est = estimate_static_memory(model, optimizer=name)
    measured = measured_static_memory(model, opt)
    assert abs(est.total - measured) <= 0.01 * measured
    assert est.total == measured  # exact for every optimizer modelled here
    if lora:
        assert est.grads < est.params / 10


def test_trainer_8bit_optimizer_keeps_embedding_states_in_fp32_and_the_estimate_follows():
    """The HF Trainer tells bitsandbytes to keep nn.Embedding states in fp32 under 8-bit
    optimizers; the estimate a Trainer run uses (`run_config` sets ``fp32_embeddings``) holds
    them, the plain 8-bit rule would not."""
    pytest.importorskip("bitsandbytes")
    from transformers import Trainer, TrainingArguments

    from adacc_hf.engine.config import AdaccConfig
    from adacc_hf.integrations.run_facts import run_config

    model = assets.tiny_model("llama")
    args = TrainingArguments(
        output_dir="/tmp/adacc-bnb", optim="adamw_bnb_8bit", use_cpu=True, report_to="none"
    )
    opt = Trainer(model=model, args=args).create_optimizer()
    model(**assets.tiny_batch("llama", model)).loss.backward()
    opt.step()
    measured = measured_static_memory(model, opt)
    cfg = run_config(AdaccConfig(), args)
    assert cfg.run.fp32_embeddings and cfg.run.optimizer == "adamw_bnb_8bit"
    est = estimate_static_memory(model, optimizer=cfg.run.optimizer, fp32_embeddings=True)
    assert est.total == measured
    assert estimate_static_memory(model, optimizer=cfg.run.optimizer).total < measured


def test_zero_and_fsdp_divide_by_world_size():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8)).to(torch.bfloat16)
    model[1].requires_grad_(False)  # frozen: no gradient, state or master copy
    n_train, n_all = 64 * 32 + 32, 64 * 32 + 32 + 32 * 8 + 8
    kw = {"mixed_precision": "bf16", "master_weights": True, "world_size": 4}
    s0 = estimate_static_memory(model, zero_stage=0, **kw)
    assert (s0.params, s0.grads) == (2 * n_all, 2 * n_train)
    assert (s0.optimizer, s0.master_weights) == (2 * 2 * n_train + 4 * 2, 4 * n_train)
    s1 = estimate_static_memory(model, zero_stage=1, **kw)
    assert (s1.params, s1.grads) == (s0.params, s0.grads)
    assert (s1.optimizer, s1.master_weights) == (s0.optimizer // 4, s0.master_weights // 4)
    s2 = estimate_static_memory(model, zero_stage=2, **kw)
    assert (s2.params, s2.grads, s2.optimizer) == (s0.params, s0.grads // 4, s1.optimizer)
    s3 = estimate_static_memory(model, zero_stage=3, **kw)
    assert s3.total == -(-s0.params // 4) + s0.grads // 4 + s1.optimizer + s1.master_weights
    fsdp = estimate_static_memory(model, fsdp=True, **kw)
    # ZeRO-3's gradient partitions are one flat buffer from start-up: resident (`comm`)
    assert (s3.grads, s3.comm) == (0, s0.grads // 4)
    assert dataclasses.replace(fsdp, note="") == dataclasses.replace(
        s3, note="", grads=s3.comm, comm=0
    )
    off = estimate_static_memory(model, zero_stage=3, offload_optimizer=True, **kw)
    assert (off.optimizer, off.master_weights, off.params) == (0, 0, s3.params)
    assert "ZeRO-3 over 4" in s3.describe() and "total" in s3.describe()


def test_master_weights_only_for_16bit_params():
    fp32 = nn.Linear(16, 16)
    amp = estimate_static_memory(fp32, mixed_precision="bf16", master_weights=True)
    assert amp.master_weights == 0  # AMP keeps fp32 params: no extra copy
    bf16 = estimate_static_memory(
        fp32.to(torch.bfloat16), mixed_precision="bf16", master_weights=True
    )
    assert bf16.master_weights == 4 * (16 * 16 + 16)


def test_optimizer_state_rules():
    model = nn.Linear(128, 64)  # 8192 + 64 elements, fp32
    n = 128 * 64 + 64
    est = {
        o: estimate_static_memory(model, optimizer=o).optimizer
        for o in ("sgd", "sgd_momentum", "lion", "adamw_hf", "adafactor", "paged_adamw_8bit")
    }
    assert est["sgd"] == 0 and est["sgd_momentum"] == est["lion"] == 4 * n
    assert est["adamw_hf"] == 8 * n
    assert est["adafactor"] == (64 + 128) * 4 + 4 + 64 * 4 + 4
    # 8-bit: 1 byte per element and state + fp32 absmax per 256; the bias (< 4096) stays fp32
    assert est["paged_adamw_8bit"] == 2 * (8192 + 4 * 32) + 2 * 64 * 4 + 2 * 1024


def test_unknown_optimizer_lists_the_known_ones():
    with pytest.raises(BudgetError, match="adamw_torch.*adafactor"):
        estimate_static_memory(nn.Linear(2, 2), optimizer="shampoo")
    with pytest.raises(BudgetError, match="zero_stage"):
        estimate_static_memory(nn.Linear(2, 2), zero_stage=4)
