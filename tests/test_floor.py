"""The floor: wherever transformers' full checkpointing fits a micro-batch (its measured step peak
within the budget), Adacc plans that micro-batch too, and its measured step peak stays within the
budget — at the tight end included (the budget exactly full checkpointing's peak, or a little
above it, where the headroom would leave less than the least step peak)."""

from __future__ import annotations

import pytest
import torch

from adacc_hf import assets, measure_step_peak
from adacc_hf.integrations.config import AdaccConfig
from adacc_hf.integrations.session import AdaccSession


def _hf_full_peak(model, batch, opt) -> int:
    enable = getattr(model, "activation_checkpointing_enable", None)
    disable = getattr(model, "activation_checkpointing_disable", None)
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
