"""A plan's last check (`BucketSolver._within_budget`): the action tables of the final policy
are measured after the last solve, so its prediction is made again with them; a plan that the
measurement puts above the budget is solved again below it, and where nothing but full
recomputation fits, it falls back to that. The truth: every allocation of the real step."""

from __future__ import annotations

import pytest
import torch

from adacc_hf import apply_adacc, assets, measure_step_peak, prepare, profile_model
from adacc_hf.errors import BudgetError
from adacc_hf.solver import budget_between, estimate_static_memory, least_memory_policy
from adacc_hf.solver.cost_model import predict


def _measured_peak(model, policy, batch) -> int:
    """Every allocation of a real step under `policy`, after two (the optimizer state exists)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    with apply_adacc(model, policy):
        for _ in range(2):
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return measure_step_peak(model, batch, opt).peak_nbytes


@pytest.mark.parametrize("room", ["some", "least", "unsolved", "none"])
def test_a_plan_found_above_its_budget_is_solved_again_below_it_or_falls_back(room, monkeypatch):
    """A plan made for a larger budget, checked against a smaller one (as if its measured
    tables had grown it): with room, or just full recomputation's, it is solved again within the
    smaller budget; where that solve fails (``unsolved``: the solver made to refuse), it becomes
    full recomputation; below that, a `BudgetError` (never a plan predicted above its budget)."""
    model = assets.tiny_model("llama")
    model.config.use_cache = False
    batch = assets.tiny_batch("llama", model, batch_size=4, seq_len=48)
    static = estimate_static_memory(model, optimizer="adamw_torch")
    prof = profile_model(model, batch, repeats=1, codecs=())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    session = prepare(
        model, budget_between(prof, static, 0.9), batch, optimizer=opt, adaptive=False,
        codecs=[], profile_repeats=1,
    )  # fmt: skip
    try:
        roomy = session.current
        before = roomy.policy.metadata["predicted"]["peak_nbytes"]
        key = roomy.key
        room_nbytes = session.store.profiling_room(batch)
        profile, probes = session.store.profile_bucket(batch, key, room_nbytes)
        least = predict(profile, least_memory_policy(profile, static), static).peak_nbytes
        # a budget the roomy plan exceeds: halfway to full recomputation's, just it, or less
        limit = {"some": (least + before) // 2, "none": least - 1}.get(room, least)
        small = session.budget_nbytes = limit + session.oom_reserve_nbytes
        assert predict(profile, roomy.policy, static).peak_nbytes > limit
        if room == "none":
            with pytest.raises(BudgetError, match="full recomputation needs"):
                session.solver._within_budget(profile, probes, roomy.policy, 0, room_nbytes)
            return
        if room == "unsolved":

            def refuse(*args, **kwargs):
                raise BudgetError("refused")

            monkeypatch.setattr(session.solver, "solve", refuse)
        policy = session.solver._within_budget(profile, probes, roomy.policy, 0, room_nbytes)
    finally:
        session.close()
    predicted = policy.metadata["predicted"]["peak_nbytes"]
    assert predicted <= limit
    variants = policy.groups["block"].variants
    if room != "unsolved":
        assert policy.metadata.get("source") != "least_memory"  # solved again
        assert policy.fingerprint() != roomy.policy.fingerprint()
    else:
        assert policy.metadata["source"] == "least_memory"
        assert policy.metadata["budget_nbytes"] == small
        assert all(v.checkpoint for v in variants)
    measured = _measured_peak(model, policy, batch)
    assert measured <= predicted <= small, (measured, predicted, small)
