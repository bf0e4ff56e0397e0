"""Mixture-of-experts under one policy while the routing changes from batch to batch.

transformers' default experts implementation (``grouped_mm``, which runs on CPU with torch 2.13)
runs a fixed op sequence whose shapes depend only on tokens x top_k, so op identity and memory
hold whatever the routing. The router's outputs are always retained: recomputing it in backward
from inputs a codec altered routes tokens differently than forward did.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import random_policy, step

from adacc_hf import (
    UnsupportedModelError,
    activation_memory_report,
    apply_adacc,
    estimate_static_memory,
    get_adapter,
    measure_step_peak,
    profile_model,
    solve_policy,
    uniform_policy,
)
from adacc_hf.schema import RECOMPUTE
from adacc_hf.solver import budget_between, planned_budget, predict
from adacc_hf.testing.families import family_batch, family_model

pytestmark = pytest.mark.usefixtures("frozen_gc")

MOE = ["qwen2_moe", "mixtral"]


def _routers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if "Router" in type(m).__name__]


class RoutingLog:
    """Records the expert indices every router call returns (forward and recompute alike)."""

    def __init__(self, model):
        self.calls: list[tuple[int, torch.Tensor]] = []
        self.handles = [
            r.register_forward_hook(
                lambda mod, a, out, i=i: self.calls.append((i, out[-1].clone()))
            )
            for i, r in enumerate(_routers(model))
        ]

    def per_router(self) -> dict[int, list[torch.Tensor]]:
        out: dict[int, list[torch.Tensor]] = {}
        for i, idx in self.calls:
            out.setdefault(i, []).append(idx)
        return out

    def close(self):
        for h in self.handles:
            h.remove()


def _steer(model):
    """Make routing depend on the tokens: channel 0 of the embedding is +5 for ids < 128 and -5
    above, and every router's last expert scores -x0 (its others stay random). Batches of low ids
    never pick that expert; batches of high ids pick it for every token."""
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        emb[:, 0] = torch.where(torch.arange(emb.shape[0]) < 128, 5.0, -5.0)
        for r in _routers(model):
            r.weight[-1] = 0.0
            r.weight[-1, 0] = -1.0


def _batches(model):
    base = family_batch(model, batch_size=8, seq_len=64)
    low = base["input_ids"] % 124 + 4  # ids 4..127
    high = low + 128
    mixed = torch.where(
        torch.rand(low.shape, generator=torch.Generator().manual_seed(1)) < 0.5, low, high
    )
    return [{**base, "input_ids": ids, "labels": ids.clone()} for ids in (low, high, mixed)]


@pytest.mark.parametrize("family", MOE)
def test_one_policy_holds_across_batches_that_route_differently(family, caplog):
    model = family_model(family)
    _steer(model)
    batches = _batches(model)
    n_experts = _routers(model)[0].weight.shape[0]
    # The routing really differs, and the last expert gets no token on the first batch.
    counts = []
    for b in batches:
        log = RoutingLog(model)
        with torch.no_grad():
            model(**b)
        log.close()
        counts.append(torch.bincount(log.calls[0][1].flatten(), minlength=n_experts))
    assert counts[0][-1] == 0 and counts[1][-1] > 0 and not torch.equal(counts[0], counts[2])

    profile = profile_model(model, batches[0], repeats=1, warmup=0)
    static = estimate_static_memory(model, optimizer="adamw_torch")
    budget = budget_between(profile, static, 0.4)
    # As a training session does: keep the headroom for batch-to-batch codec size variation.
    solved = solve_policy(profile, planned_budget(budget, static, profile), static_nbytes=static)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kinds = {a.kind for g in solved.groups.values() for v in g.variants for a in v.actions.values()}
    assert {"retain", "recompute"} <= kinds  # a mixed policy, not a corner case
    lossless = random_policy(model, batches[0], seed=2)
    with caplog.at_level(logging.WARNING, logger="adacc_hf"):
        for i, b in enumerate(batches):
            ref_loss, ref_grads, _ = step(model, b)
            with apply_adacc(model, lossless) as handle:
                loss, grads, _ = step(model, b)
                assert not handle.unknown_ops
            assert torch.equal(loss, ref_loss), i
            assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads), i
            with apply_adacc(model, solved) as handle:
                torch.manual_seed(0)
                held = activation_memory_report(model, b).total
                peak = measure_step_peak(model, b, opt).peak_nbytes  # a whole AdamW step
                assert not handle.unknown_ops
            predicted = predict(profile, solved, static).held_nbytes
            assert peak <= budget, (i, peak, budget)
            assert abs(held - predicted) <= 0.05 * predicted, (i, held, predicted)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _near_tie(model):
    """Routers whose first two experts score almost the same: the smallest change to a router's
    input swaps them."""
    with torch.no_grad():
        for r in _routers(model):
            r.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
            r.weight[1] = r.weight[0] + 1e-3 * r.weight[1]


def _recompute_routing(model, batch, policy) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(forward, recompute) expert indices of every router under `policy`."""
    log = RoutingLog(model)
    with apply_adacc(model, policy):
        step(model, batch)
    log.close()
    pairs = []
    for calls in log.per_router().values():
        assert len(calls) == 2  # forward, then backward's recompute
        pairs.append((calls[0], calls[1]))
    return pairs


@pytest.mark.parametrize("family", MOE)
def test_router_outputs_are_retained_so_recompute_routes_as_forward(family):
    model = family_model(family)
    _near_tie(model)
    batch = family_batch(model)
    policy = uniform_policy(model, "compress", batch)  # lossy inputs reach the recomputed router
    routers = {
        (g, op.key) for g, gp in policy.groups.items() for op in gp.ops if op.layer_type == "router"
    }
    assert routers
    for g, key in routers:
        if policy.groups[g].op(key).cacheable:
            assert policy.groups[g].variants[0].action(key).kind == "retain", key
    for fwd, rec in _recompute_routing(model, batch, policy):
        assert torch.equal(fwd, rec)
    # The same policy with the router recomputed routes some tokens elsewhere in backward: what
    # retaining it prevents (and proof that this test can fail).
    for g, key in routers:
        policy.groups[g].variants[0].actions[key] = RECOMPUTE
    pairs = _recompute_routing(model, batch, policy)
    assert any(not torch.equal(fwd, rec) for fwd, rec in pairs)


@pytest.mark.parametrize("family", MOE)
def test_a_router_the_runtime_cannot_retain_makes_its_block_keep_nothing_lossy(family):
    """A forward hook installed on the router after the policy was made runs one op more in the
    router's region, so the runtime cannot align that region and keeps none of its ops. The
    router then reruns in backward, so every lossy encoding in its block is dropped too: the block
    recomputes from exact values, and its gradients equal the unpatched model's bit for bit."""
    model = family_model(family)
    _near_tie(model)
    batch = family_batch(model)
    policy = uniform_policy(model, "compress", batch)
    for gp in policy.groups.values():
        if not any(op.layer_type == "router" for op in gp.ops):
            gp.variants[0].actions.clear()  # Qwen2-MoE's dense blocks: exact, plain checkpointing
    lossy = {
        k for gp in policy.groups.values() for k, a in gp.variants[0].actions.items()
        if a.kind == "compress" and a.codec != "bitpack"
    }  # fmt: skip
    assert lossy
    ref_loss, ref_grads, _ = step(model, batch)
    log = RoutingLog(model)  # its hook clones the expert indices: an op the policy never saw
    with apply_adacc(model, policy) as handle:
        loss, grads, _ = step(model, batch)
        kept = {k for rt in handle.runtimes.values() for k in rt.last_bytes}
        problems = handle.problems
    log.close()
    assert any("router" in p and "lossy" in p for p in problems)
    assert not kept & lossy
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
    for fwd, rec in log.per_router().values():  # forward, then backward's recompute
        assert torch.equal(fwd, rec)


def test_eager_experts_loop_is_refused_with_what_to_change():
    model = family_model("mixtral")
    model.set_experts_implementation("eager")
    with pytest.raises(UnsupportedModelError, match="grouped_mm"):
        get_adapter(model)
    model.set_experts_implementation("grouped_mm")
    assert get_adapter(model).block_groups(model)
