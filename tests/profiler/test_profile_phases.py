"""Where profiling time goes (issue 32): the phases add up to the wall time measured around the
call, and a run that keeps the model's own LM head spends nothing on measuring other heads, with
the same step model as when it does."""

from __future__ import annotations

import time

import torch

from adacc_hf import assets, estimate_static_memory, profile_model
from adacc_hf.profiler.phases import PHASES, format_phases
from adacc_hf.solver import budget_between, predict, solve


def tiny():
    model = assets.tiny_model("llama", seed=0, num_hidden_layers=4)
    return model, assets.tiny_batch("llama", model, batch_size=2, seq_len=64)


def test_the_phases_add_up_to_the_wall_time():
    model, batch = tiny()
    t0 = time.perf_counter()
    profile = profile_model(model, batch, repeats=1, codecs=[])
    wall = (time.perf_counter() - t0) * 1e3
    ms = profile.phase_ms
    print(f"wall {wall:.0f} ms; {format_phases(ms)}")
    assert set(ms) <= set(PHASES), ms
    assert all(ms.get(k, 0) > 0 for k in ("ops", "calibration", "memory", "head")), ms
    assert abs(sum(ms.values()) - wall) <= 0.02 * wall + 5, (sum(ms.values()), wall)


def test_the_models_own_head_alone_is_not_measured_and_plans_the_same():
    model, batch = tiny()
    static = estimate_static_memory(model, optimizer="adamw_torch")
    every = profile_model(model, batch, repeats=1, codecs=[], head="auto")
    own = profile_model(model, batch, repeats=1, codecs=[], head="full")
    assert set(every.heads) == {"full", "chunked"} and own.heads == {}
    assert own.phase_ms["head"] < 0.25 * every.phase_ms["head"], (own.phase_ms, every.phase_ms)
    for fraction in (0.2, 0.6):
        budget = budget_between(every, static, fraction)
        a = solve(every, budget, static_nbytes=static, head="full").policy
        b = solve(own, budget, static_nbytes=static, head="full").policy
        # The two profiles are timed apart, so under load their solves may pick other plans:
        # each plan is predicted on both, and the memory the step model gives it is the same.
        for policy in (a, b):
            assert (
                predict(every, policy, static).peak_nbytes
                == predict(own, policy, static).peak_nbytes
            )


def test_the_own_head_is_measured_when_the_timeline_may_not_fit_with_it():
    """Inside a room too small for the full head's logits, every way is measured (the timeline
    runs the chunked head and is moved back by their difference), as before."""
    model, batch = tiny()
    logits = batch["input_ids"].numel() * model.config.vocab_size * 4
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    room = params + logits // 4
    profile = profile_model(model, batch, repeats=1, codecs=[], head="full", room=room)
    assert set(profile.heads) == {"full", "chunked"}, (profile.heads, room)
    assert torch.isfinite(torch.tensor(profile.heads["full"].ms))
