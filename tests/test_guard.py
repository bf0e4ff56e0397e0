"""CUDA's allocator: expandable segments by default, and the guard that re-plans a bucket whose
step reserved more than the budget.

On CPU there is no caching allocator: the allocator switch is checked through its setter, and the
guard through a reader that reports a chosen reserved level; the re-planned step's peak is then
measured on real storages (`measure_step_peak`) against the budget minus the overshoot.
"""

from __future__ import annotations

import logging

import pytest
import torch

from adacc_hf import assets, measure_step_peak, prepare, profile_model
from adacc_hf.runtime import allocator
from adacc_hf.solver import budget_between, estimate_static_memory


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA that records allocator settings instead of applying them."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(allocator, "_set", calls.append)
    monkeypatch.setattr(allocator, "_done", False)
    for var in (*allocator._TORCH_VARS, allocator.ENV_VAR):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_expandable_segments_are_turned_on_once_where_the_user_set_nothing(fake_cuda, caplog):
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        assert allocator.use_expandable_segments()
        assert not allocator.use_expandable_segments()  # once per process
    assert fake_cuda == ["expandable_segments:True"]
    assert "expandable segments" in caplog.text and allocator.ENV_VAR in caplog.text


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128"),
        ("PYTORCH_ALLOC_CONF", "expandable_segments:False"),
        (allocator.ENV_VAR, "default"),
    ],
)
def test_a_users_allocator_setting_or_opt_out_is_left_alone(fake_cuda, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    assert not allocator.use_expandable_segments()
    assert fake_cuda == []


def test_the_config_option_opts_out_and_cpu_is_never_touched(fake_cuda, monkeypatch):
    assert not allocator.use_expandable_segments(enabled=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(allocator, "_done", False)
    assert not allocator.use_expandable_segments()
    assert fake_cuda == []
    assert allocator.reserved_nbytes(torch.device("cpu")) is None


def test_a_step_reserving_over_the_budget_replans_its_bucket_with_the_overshoot_kept_free():
    model = assets.tiny_model("llama")
    batch = assets.tiny_batch("llama", model, batch_size=4, seq_len=64)
    static = estimate_static_memory(model, optimizer="sgd")
    budget = budget_between(profile_model(model, batch, repeats=1), static, 0.6)
    session = prepare(model, budget, batch, optimizer="sgd", adaptive=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    first = measure_step_peak(model, batch, opt).peak_nbytes
    assert first <= budget
    over = (budget - first) // 2 + (1 << 20)  # what a CUDA allocator could add on top
    session.guard.read = lambda device: first + over  # reserved after the step
    session.step_done(1)
    event = session.events[-1]
    assert event.kind == "guard" and session.current.stale
    session.guard.read = lambda device: None
    peak = measure_step_peak(model, batch, opt).peak_nbytes  # the next forward re-plans
    plan = session.current
    assert plan.reserve_nbytes == first + over - budget + (2 << 20) and not plan.stale
    assert peak + over <= budget + (2 << 20), (peak, over, budget)
    assert peak <= first  # (equal where the first plan was already full recomputation: on a
    # loaded CPU keeping ops can price above recomputing them)
    session.step_done(2)
    assert session.events[-1].kind != "guard"  # within the budget now: nothing more
    session.close()
