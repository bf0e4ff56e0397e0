"""No lossy input beside an exact saved statistic: every policy source obeys the rule, and the
solver's optimum under it equals a brute-force search over the consistent policies."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_solver import best_time, exhaustive, group, op, profile

from adacc_hf import apply_adacc, assets, uniform_policy
from adacc_hf.policy.consistency import conflicts, keeps_statistics
from adacc_hf.schema import Action
from adacc_hf.solver import no_checkpoint_budget, solve
from adacc_hf.units import MiB


def _attention_profile(num_blocks: int):
    """q, k (cheap to compress), a fused attention op expensive to recompute, an output proj."""
    rng = random.Random(3)
    codecs = ("int4_asym", "int4_channel")
    ops = [
        op("attn/q#0", "qkv", 64 * 2048, 0.30, codecs),
        op("attn/k#0", "qkv", 64 * 2048, 0.30, codecs),
        op("attn/sdpa#0", "attn_fused", 64 * 4096, 2.5, codecs),
        op("attn/o#0", "attn_out", 64 * 2048, 0.35, codecs),
    ]
    for o in ops:
        for cp in o.codecs.values():
            cp.encode_ms, cp.decode_ms = rng.uniform(0.01, 0.03), rng.uniform(0.01, 0.03)
    g = group("layers", num_blocks, ops, x_numel=64 * 1024, fixed_ms=0.05)
    return profile([g], nonblock=MiB)


def _no_conflicts(policy) -> bool:
    return all(
        not conflicts(g.ops, v.actions, v.checkpoint)
        for g in policy.groups.values()
        for v in g.variants
    )


@pytest.mark.parametrize("split", [True, False], ids=["split_blocks", "one_policy"])
def test_the_solver_finds_the_best_consistent_policy_and_the_rule_binds(split):
    prof = _attention_profile(2)
    static = 5 * MiB
    ms, peak = exhaustive(prof, static, split, consistent=True)
    free_ms, free_peak = exhaustive(prof, static, split)
    lo, hi = int(peak.min()), no_checkpoint_budget(prof, static)
    binds = False
    for b in sorted({int(x) for x in np.linspace(lo, hi, 12)}):
        sol = solve(
            prof, b, static_nbytes=static, split_blocks=split, max_rel_error=None, mip_gap=0
        )
        assert sol.added_ms == pytest.approx(best_time(ms, peak, b), abs=1e-6), b
        assert _no_conflicts(sol.policy), (b, sol.policy.table())
        binds |= best_time(free_ms, free_peak, b) < best_time(ms, peak, b) - 1e-6
    assert binds  # some budget's unconstrained optimum keeps attention beside a lossy q / k


def test_uniform_compress_recomputes_the_fused_attention_it_would_feed_lossily():
    model = assets.tiny_model("llama", attention_dropout=0.0)  # CPU SDPA takes its fused path
    batch = assets.tiny_batch("llama", model)
    policy = uniform_policy(model, "compress", batch)
    g = policy.groups["block"]
    fused = [o for o in g.ops if keeps_statistics(o)]
    assert fused and all(g.variants[0].action(o.key).kind == "recompute" for o in fused)
    assert _no_conflicts(policy)


def test_a_hand_made_policy_breaking_the_rule_is_repaired_with_a_warning():
    model = assets.tiny_model("llama", attention_dropout=0.0)
    batch = assets.tiny_batch("llama", model)
    policy = uniform_policy(model, "compress", batch)
    g = policy.groups["block"]
    fused = next(o for o in g.ops if keeps_statistics(o))
    g.variants[0].actions[fused.key] = Action.retain()
    assert not _no_conflicts(policy)
    with pytest.warns(UserWarning, match="lossy input"), apply_adacc(model, policy):
        model(**batch).loss.backward()
    assert _no_conflicts(policy) and g.variants[0].action(fused.key).kind == "recompute"


def test_lossless_codecs_taint_nothing():
    model = assets.tiny_model("llama", attention_dropout=0.0)
    batch = assets.tiny_batch("llama", model)
    policy = uniform_policy(model, "retain", batch)  # no checkpointing: nothing to check
    assert _no_conflicts(policy)
    g = uniform_policy(model, "recompute", batch).groups["block"]
    fused = next(o for o in g.ops if keeps_statistics(o))
    masks = {o.key: Action.compress("bitpack") for o in g.ops if o.dtype == str(torch.bool)}
    assert not conflicts(g.ops, {**masks, fused.key: Action.retain()})


def _error_profile(num_blocks: int):
    """Four ops whose codecs cost almost nothing but move the gradients by different amounts."""
    rng = random.Random(5)
    codecs = ("int4_asym", "int4_channel")
    ops = [op(f"mlp/op#{i}", "mlp_up", 64 * 2048, 0.3 + 0.1 * i, codecs) for i in range(4)]
    for o in ops:
        for cp in o.codecs.values():
            cp.encode_ms, cp.decode_ms = rng.uniform(0.005, 0.02), rng.uniform(0.005, 0.02)
            cp.grad_error = rng.uniform(0.02, 0.12)
    g = group("layers", num_blocks, ops, x_numel=64 * 1024, fixed_ms=0.05)
    return profile([g], nonblock=MiB)


@pytest.mark.parametrize("bound", [0.0, 0.06, 0.12, 0.2])
def test_the_gradient_error_bound_gives_the_best_policy_within_it(bound):
    """One action table for every block: the MILP's bound (codec errors in quadrature) is
    exact, so its optimum equals an exhaustive search over the tables within the bound; with
    blocks split, every block is within the bound and no faster than the unbounded optimum."""
    prof, static = _error_profile(2), 5 * MiB
    ms, peak = exhaustive(prof, static, False, max_grad_error=bound)
    free_ms, free_peak = exhaustive(prof, static, False)
    split_ms, split_peak = exhaustive(prof, static, True)
    lo, hi = int(peak.min()), no_checkpoint_budget(prof, static)
    binds = False
    for b in sorted({int(x) for x in np.linspace(lo, hi, 8)}):
        kw = dict(static_nbytes=static, max_rel_error=None, mip_gap=0, max_grad_error=bound)
        one = solve(prof, b, split_blocks=False, **kw)
        assert one.added_ms == pytest.approx(best_time(ms, peak, b), abs=1e-6), b
        split = solve(prof, b, **kw)
        for sol in (one, split):
            assert sol.policy.metadata["predicted"]["grad_error"] <= bound + 1e-9
        free = best_time(free_ms, free_peak, b)
        binds |= free < one.added_ms - 1e-6
        assert split.added_ms >= best_time(split_ms, split_peak, b) - 1e-6
    assert binds or bound >= 0.2
