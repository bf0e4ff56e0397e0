"""The floor: wherever transformers' checkpointing fits a micro-batch (its measured step peak within
the budget), Adacc plans that micro-batch too, and its measured step peak stays within the budget
— at the tight end included (the budget exactly full checkpointing's peak, or a little above it,
where the headroom would leave less than the least step peak); and where transformers'
``every_n_layers=k`` fits, Adacc plans no more recomputation than it."""

from __future__ import annotations

import pytest
import torch

from adacc_hf import assets, measure_step_peak
from adacc_hf.engine.config import AdaccConfig
from adacc_hf.engine.session import AdaccSession
from adacc_hf.solver import estimate_static_memory, predict


def _hf_full_peak(model, batch, opt, every_n: int = 1) -> int:
    enable = getattr(model, "activation_checkpointing_enable", None)
    disable = getattr(model, "activation_checkpointing_disable", None)
    if every_n > 1:  # transformers >= 5.2x
        enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every_n)
    else:
        (enable or model.gradient_checkpointing_enable)()
    try:
        measure_step_peak(model, batch, opt)  # optimizer states exist
        return measure_step_peak(model, batch, opt).peak_nbytes
    finally:
        (disable or model.gradient_checkpointing_disable)()


@pytest.mark.parametrize(
    "family",
    ["gpt2", pytest.param("llama", marks=pytest.mark.slow)],  # llama: make test-all
)
def test_adacc_fits_where_full_checkpointing_fits(family):
    model = assets.tiny_model(family)
    batch = assets.tiny_batch(family, model, batch_size=4, seq_len=48)
    batch["labels"] = batch["input_ids"]  # one storage, as benchmarks and many collators pass it
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    hf = _hf_full_peak(model, batch, opt)
    profiles: dict = {}  # one profile for every budget
    for budget in (hf, hf + hf // 200, hf + hf // 50):
        session = AdaccSession(
            model, AdaccConfig(budget=budget, adaptive=False, profile_repeats=1), profiles=profiles
        )
        session.setup(batch)  # raised BudgetError at `hf`: the batch counted twice
        try:
            measured = measure_step_peak(model, batch, opt).peak_nbytes
        finally:
            session.close()
        assert measured <= budget, (budget - hf, measured - budget, session.policy.summary())
        assert session.policy.metadata["status"] != "fallback"


@pytest.mark.slow  # ~1 min: a comparison with transformers' every_n_layers at several budgets
def test_adacc_plans_no_more_recompute_than_every_n_layers_where_it_fits():
    """At the budget transformers' ``every_n_layers=k`` measures (its plain layers' checkpoint
    frames counted right: a plain block stashes no generator state), Adacc finds a plan at least
    as cheap: no more recompute time than k's checkpointed layers, and it fits."""
    model = assets.tiny_model("llama", num_hidden_layers=8)
    batch = assets.tiny_batch("llama", model, batch_size=4, seq_len=48)
    batch["labels"] = batch["input_ids"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    measure_step_peak(model, batch, opt)  # optimizer states exist
    profiles: dict = {}
    for k in (2, 4):
        budget = _hf_full_peak(model, batch, opt, every_n=k)
        # adaptive, as the Trainer's default: a plan of retain / recompute keeps no tracking room
        session = AdaccSession(
            model, AdaccConfig(budget=budget, profile_repeats=1), profiles=profiles
        )
        session.setup(batch)
        try:
            measured = measure_step_peak(model, batch, opt).peak_nbytes
        finally:
            session.close()
        profile, static = session.profile, estimate_static_memory(model, optimizer="adamw_torch")
        g = profile.groups["block"]
        block_ms = g.fixed_ms + sum(op.fwd_ms for op in g.ops if op.cacheable)
        hf_ms = (g.num_blocks // k) * block_ms  # layers 0, k, 2k, ... fully recomputed
        ours = predict(profile, session.policy, static, measured_ms=False).added_ms
        assert measured <= budget, (k, measured - budget)
        assert ours <= hf_ms * (1 + 1e-9), (k, ours, hf_ms, session.policy.summary())
