"""The runtime's dispatch overhead is measured and priced: a checkpointed block that keeps any op
pays ``dispatch_ms`` (its ops crossing the dispatch modes in forward and recompute), a block that
keeps nothing runs transformers' plain checkpoint and pays nothing. The solver keeps ops only when
what they save in recompute exceeds that overhead."""

from __future__ import annotations

import dataclasses

from test_solver import llama_profile

from adacc_hf import assets, profile_model
from adacc_hf.solver import predict, solve
from adacc_hf.units import MiB


def _with_dispatch(prof, ms):
    for name, g in prof.groups.items():
        prof.groups[name] = dataclasses.replace(g, dispatch_ms=ms)
    return prof


def _kept(policy) -> int:
    return sum(
        v.count * any(a.kind != "recompute" for a in v.actions.values())
        for g in policy.groups.values()
        for v in g.variants
        if v.checkpoint
    )


def test_blocks_keep_ops_only_when_that_saves_more_than_the_dispatch_overhead():
    def prof(dispatch_ms):
        return _with_dispatch(llama_profile(num_blocks=4, seq=256, hidden=256), dispatch_ms)

    g = prof(0.0).groups["layers"]
    # Every block must be checkpointed, with room to keep a few ops in each.
    budget = prof(0.0).full_recompute_nbytes() + g.transient_nbytes + 6 * MiB
    free = solve(prof(0.0), budget, split_blocks=False)
    assert _kept(free.policy) == 4  # keeping is free: every block keeps its best ops
    full_ms = g.num_blocks * (g.fixed_ms + sum(o.fwd_ms for o in g.ops if o.cacheable))
    gain = (full_ms - free.added_ms) / g.num_blocks  # what keeping saves per block
    assert gain > 0
    worth = solve(prof(0.5 * gain), budget, split_blocks=False)
    assert _kept(worth.policy) == 4  # still worth it
    costly = prof(2 * gain)
    sol = solve(costly, budget, split_blocks=False)
    assert _kept(sol.policy) == 0  # keeping costs more than it saves: plain checkpoints
    assert abs(sol.added_ms - full_ms) < 1e-6
    # the cost model charges the overhead to blocks that keep something, and only to them
    charged = predict(costly, free.policy).added_ms - predict(prof(0.0), free.policy).added_ms
    assert abs(charged - 4 * 2 * gain) < 1e-6
    assert predict(costly, sol.policy).added_ms == predict(prof(0.0), sol.policy).added_ms


def test_the_profiler_measures_the_dispatch_overhead_of_a_block():
    model = assets.tiny_model("llama")
    prof = profile_model(model, assets.tiny_batch("llama", model), repeats=3)
    g = prof.groups["block"]
    assert g.dispatch_ms > 0  # every op crosses the modes: never free
    again = type(prof).from_json(prof.to_json())
    assert again.groups["block"].dispatch_ms == g.dispatch_ms
