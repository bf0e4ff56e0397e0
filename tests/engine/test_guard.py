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
    """A CUDA that records allocator settings (and cache emptying) instead of applying them: the
    real switch runs only on a GPU (``gpu_suite.py --part budget`` measures it, each case in a
    process of its own)."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(allocator, "_set", calls.append)
    monkeypatch.setattr(allocator, "_done", False)
    monkeypatch.setattr(allocator, "_on", False)
    for var in (*allocator._TORCH_VARS, allocator.ENV_VAR):
        monkeypatch.delenv(var, raising=False)
    return calls


def test_import_turns_expandable_segments_on_before_cuda_starts(fake_cuda, caplog):
    allocator.at_import()
    assert fake_cuda == ["expandable_segments:True"]
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        assert not allocator.use_expandable_segments()  # already on: the session has nothing to do
    assert fake_cuda == ["expandable_segments:True"]


def test_a_session_on_a_started_cuda_empties_the_cache_then_switches(
    fake_cuda, monkeypatch, caplog
):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    allocator.at_import()  # too late: CUDA runs
    assert fake_cuda == []
    with caplog.at_level(logging.INFO, logger="adacc_hf"):
        assert allocator.use_expandable_segments()
        assert not allocator.use_expandable_segments()  # once per process
    assert fake_cuda == ["empty_cache", "expandable_segments:True"]
    assert "cache emptied" in caplog.text and allocator.ENV_VAR in caplog.text


def test_the_option_off_switches_back_what_import_turned_on(fake_cuda):
    allocator.at_import()
    assert allocator.use_expandable_segments(enabled=False)
    assert fake_cuda == ["expandable_segments:True", "empty_cache", "expandable_segments:False"]


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
    allocator.at_import()
    assert not allocator.use_expandable_segments()
    assert fake_cuda == []


def test_a_cpu_build_is_never_touched(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    allocator.at_import()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not allocator.use_expandable_segments()
    assert fake_cuda == []
    assert allocator.reserved_nbytes(torch.device("cpu")) is None


@pytest.mark.slow  # ~1.5 min (make test-all); the guard's allocator reading is checked above
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
    # a bucket planned later starts with what the guard learned the allocator adds
    shorter = assets.tiny_batch("llama", model, batch_size=4, seq_len=32)
    model(**shorter).loss.backward()  # its forward plans the new bucket
    assert session.current.key != plan.key
    assert session.current.reserve_nbytes == plan.reserve_nbytes
    session.close()
