"""The rectifier: tracking steps back off exponentially, and a real shift in the activations
(outlier channels appearing mid-training) switches the policy at the next tracking step."""

from __future__ import annotations

import pytest
import torch

from adacc_hf import assets, estimate_static_memory, measure_step_peak, profile_model
from adacc_hf.codecs import get_codec
from adacc_hf.engine.config import AdaccConfig
from adacc_hf.engine.facts import RunFacts
from adacc_hf.engine.session import AdaccSession
from adacc_hf.engine.shapes import shape_key
from adacc_hf.evolution import (
    CodecStats,
    OutlierTracker,
    TrackingSchedule,
    apply_stats,
    should_switch,
    tracking_need,
)
from adacc_hf.solver import budget_between, predict, solve


def test_tracking_steps_back_off_exponentially_and_reset_on_change():
    s = TrackingSchedule(max_interval=8)
    tracked = []
    for step in range(1, 60):
        if s.is_tracking_step(step):
            tracked.append(step)
            s.advance(step, changed=(step == 24))
    assert tracked[:6] == [1, 2, 4, 8, 16, 24]  # 1, 2, 4, 8 apart, then capped at 8
    i = tracked.index(24)  # a change restarts the backoff
    assert tracked[i + 1 : i + 5] == [25, 27, 31, 39]
    with pytest.raises(ValueError):
        TrackingSchedule(max_interval=0)


def _setup(adaptive: bool, max_codec_error: float = 0.3, max_grad_error: float | None = None):
    model = assets.tiny_model(
        "llama",
        seed=0,
        hidden_size=512,
        intermediate_size=2048,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=4,  # activations, not the gradients, set the step's peak
    )
    batch = assets.tiny_batch("llama", model, batch_size=4, seq_len=128)
    static = estimate_static_memory(model, optimizer="sgd")
    prof = profile_model(model, batch, codecs=["int4_naive"], repeats=2)
    for g in prof.groups.values():  # compressing must pay whatever this CPU's codec timings
        g.dispatch_ms = 0.0
        for op in g.ops:
            for c in op.codecs.values():
                c.encode_ms = c.decode_ms = 0.0
    budget = budget_between(prof, static, 0.4)
    cfg = AdaccConfig(
        budget=budget,
        codecs=["int4_naive"],
        adaptive=adaptive,
        max_codec_error=max_codec_error,
        max_grad_error=max_grad_error,
        head="full",  # the budget was placed between the full head's extremes
        run=RunFacts(optimizer="sgd"),
    )
    session = AdaccSession(model, cfg, profiles={shape_key(batch, False): prof})
    session.setup(batch)
    session.on_step_begin(1)
    return model, batch, session


def _compressed(policy) -> int:
    return sum(
        a.kind == "compress"
        for g in policy.groups.values()
        for v in g.variants
        for a in v.actions.values()
    )


def _compressed_keys(policy) -> set[str]:
    return {
        k
        for v in policy.groups["block"].variants
        for k, a in v.actions.items()
        if a.kind == "compress"
    }


def _train(model, batch, session, steps=12, shift_at=5):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    events = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = model(**batch).loss
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        if step == shift_at:
            with torch.no_grad():  # outlier channels appear in every projection's output
                for name, p in model.named_parameters():
                    if name.endswith("proj.weight"):
                        p[:4] *= 80.0
        ev = session.step_done(step)
        if ev is not None:
            events.append(ev)
    return events


@pytest.mark.slow  # 81 s in the default run; the 2-rank switch test (tests/integrations/test_distributed.py) keeps a switch there
def test_outlier_shift_switches_policy_at_the_next_tracking_step():
    model, batch, session = _setup(adaptive=True)
    first = session.policy
    assert _compressed(first) > 0, "naive INT4 should be worth it before the shift"
    events = _train(model, batch, session)
    assert session.schedule.history[:4] == [1, 2, 4, 8]
    switches = [e for e in events if e.kind == "switch"]
    assert switches and switches[0].step == 8  # first tracking step after the shift at step 5
    assert all(e.kind != "switch" for e in events if e.step < 8)
    assert session.schedule.history[4] == 9  # the backoff restarts after a switch
    # The naive codec's error on the shifted activations is now above the limit on some ops the
    # first policy compressed; the new policy compresses only ops still within it.
    errors = {
        o.key: c.rel_error
        for o in session.profile.groups["block"].ops
        for c in o.codecs.values()
        if c.codec == "int4_naive"
    }
    before, after = _compressed_keys(first), _compressed_keys(session.policy)
    assert any(errors[k] > 0.3 for k in before)
    assert after and all(errors[k] <= 0.3 for k in after)
    session.close()


def test_gradient_error_drift_switches_to_a_policy_within_the_bound():
    """Tracking scales an op's measured gradient error with its codec's live error: a policy
    within the bound on the profile leaves it when its codecs' errors triple, the rectifier then
    switches, and the new policy is within the bound again."""
    from test_consistency import _error_profile

    prof, static = _error_profile(2), 5 * 2**20
    budget = budget_between(prof, static, 0.3)
    kw = dict(static_nbytes=static, max_rel_error=None, max_grad_error=0.1)
    first = solve(prof, budget, **kw).policy
    used = {
        (k, a.codec)
        for v in first.groups["layers"].variants
        for k, a in v.actions.items()
        if a.kind == "compress"
    }
    assert used and predict(prof, first, static).grad_error <= 0.1
    stats = {}
    for op in prof.groups["layers"].ops:
        for name, cp in op.codecs.items():
            if (op.key, name) in used:
                per = cp.nbytes / op.numel
                stats[("layers", op.key, name)] = CodecStats(1, per, 3 * cp.rel_error, 0.0)
    drifted, changes = apply_stats(prof, stats)
    assert changes and predict(drifted, first, static).grad_error > 0.1
    new = solve(drifted, budget, **kw).policy
    assert predict(drifted, new, static).grad_error <= 0.1
    assert should_switch(
        drifted, first, new, static, budget_nbytes=budget, max_rel_error=1.0, max_grad_error=0.1
    )
    assert not should_switch(prof, first, new, static, budget_nbytes=budget, max_rel_error=1.0)


@pytest.mark.slow  # 17 s; the switch itself is tested by the outlier-shift test
def test_adaptive_off_never_tracks_or_switches():
    model, batch, session = _setup(adaptive=False)
    first = session.policy
    events = _train(model, batch, session)
    assert events == [] and session.schedule.history == []
    assert session.policy.fingerprint() == first.fingerprint()
    session.close()


def test_tracking_measures_only_codecs_the_solver_could_choose():
    """A codec no faster than recomputing its op is never chosen (by the solver, at any budget,
    even encoding to one byte with no error), so tracking does not pay to measure it; a tracking
    step with every codec that slow measures nothing."""
    model = assets.tiny_model("llama", seed=0, num_hidden_layers=2)
    batch = assets.tiny_batch("llama", model, batch_size=2, seq_len=32)
    prof = profile_model(model, batch, codecs=["int4_naive"], repeats=1)
    slow = set()
    for g in prof.groups.values():
        g.dispatch_ms = 0.0
        coded = [op for op in g.ops if op.codecs and op.cacheable and op.fwd_ms > 0]
        assert len(coded) >= 4
        for i, op in enumerate(coded):
            for c in op.codecs.values():  # the best case for compressing: tiny and exact
                c.nbytes, c.rel_error = 1, 0.0
                c.encode_ms, c.decode_ms = (op.fwd_ms, 0.0) if i % 2 else (0.0, 0.0)
            if i % 2:
                slow.add((g.name, op.key))
    tracked = set(OutlierTracker(prof).codecs)
    assert tracked and not tracked & slow
    chosen = set()
    for fraction in (0.0, 0.2, 0.5, 0.8):
        policy = solve(prof, budget_between(prof, 0, fraction)).policy
        for name, gp in policy.groups.items():
            for v in gp.variants:
                chosen |= {
                    (name, k)
                    for k, a in v.actions.items()
                    # a lossless codec (bool masks: bitpack) has nothing to track
                    if a.kind == "compress" and not get_codec(a.codec).lossless
                }
    assert chosen and chosen <= tracked  # the fast codecs are chosen, the slow ones never

    for g in prof.groups.values():  # now every codec is slower than its op's recompute
        for op in g.ops:
            for c in op.codecs.values():
                c.encode_ms = op.fwd_ms + 1.0
    static = estimate_static_memory(model, optimizer="sgd")
    budget = budget_between(prof, static, 0.5)
    cfg = AdaccConfig(
        budget=budget, codecs=["int4_naive"], head="full", run=RunFacts(optimizer="sgd")
    )
    session = AdaccSession(model, cfg, profiles={shape_key(batch, False): prof})
    session.setup(batch)
    session.on_step_begin(1)
    tracker = session.rectifier.tracker
    assert tracker is not None and not tracker.codecs
    model(**batch).loss.backward()
    assert tracker.stats == {}
    assert session.on_step_end(1).kind == "track"
    session.close()


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("gpt2", {}),  # layer norm: (output, mean, rstd)
        ("llama", dict(hidden_size=128, num_attention_heads=4, attention_dropout=0.0)),  # + lse
    ],
)
def test_tracking_the_profiled_batch_moves_no_codec_size(family, overrides):
    """Codec payloads do not depend on the data, so a tracking step on the very batch that was
    profiled measures each codec at the size the profile has, multi-output ops included (their
    other outputs are not the codec's: measuring them as if they were made ranks that saw
    different rows disagree on sizes and re-solve to different policies)."""
    model = assets.tiny_model(family, seed=0, **overrides)
    batch = assets.tiny_batch(family, model, batch_size=2, seq_len=128)
    prof = profile_model(model, batch, codecs=["int4_naive", "int4_channel"], repeats=1)
    for g in prof.groups.values():  # every codec worth tracking
        g.dispatch_ms = 0.0
        for op in g.ops:
            for c in op.codecs.values():
                c.encode_ms = c.decode_ms = 0.0
    assert any(op.side_nbytes and op.codecs for g in prof.groups.values() for op in g.ops)
    tracker = OutlierTracker(prof)
    static = estimate_static_memory(model, optimizer="sgd")
    cfg = AdaccConfig(
        budget=budget_between(prof, static, 0.5), codecs=["int4_naive", "int4_channel"],
        head="full", run=RunFacts(optimizer="sgd"),
    )  # fmt: skip
    session = AdaccSession(model, cfg, profiles={shape_key(batch, False): prof})
    session.setup(batch)
    session.handle.set_tracker(tracker)
    torch.manual_seed(0)
    model(**batch).loss.backward()
    session.close()
    assert tracker.stats
    tracked, changes = apply_stats(prof, tracker.stats)
    sizes = {
        (g.name, op.key, c.codec): c.nbytes
        for g in tracked.groups.values() for op in g.ops for c in op.codecs.values()
    }  # fmt: skip
    for group, key, codec in tracker.stats:
        op = next(o for o in prof.groups[group].ops if o.key == key)
        assert sizes[(group, key, codec)] == op.codecs[codec].nbytes, (key, codec, changes)


@pytest.mark.parametrize("family", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_tracking_steps_stay_within_the_budget(family):
    """A tracking step measures codecs mid-forward on live activations (the payload, a decoded
    copy, the error's float32 pieces) and keeps a small device buffer all step: in bf16, where
    those copies are twice the activation's size, its measured step peak stays within the
    budget from full recomputation's peak (nothing measured: no room) up, and a plan that runs
    lossy codecs leaves the room to re-measure them (`tracking_need`)."""
    codecs = ["int4_naive", "int4_channel", "int4_asym"]
    layers = {"n_layer": 4} if family == "gpt2" else {"num_hidden_layers": 4}
    model = assets.tiny_model(family, seed=0, **layers)
    batch = assets.tiny_batch(family, model, batch_size=4, seq_len=64)
    static = estimate_static_memory(model, optimizer="adamw_torch", mixed_precision="bf16")
    prof = profile_model(model, batch, codecs=codecs, repeats=1, autocast=torch.bfloat16)
    for g in prof.groups.values():  # every codec worth tracking
        g.dispatch_ms = 0.0
        for op in g.ops:
            for c in op.codecs.values():
                c.encode_ms = c.decode_ms = 0.0
    measured = []
    for fraction in (0.0, 0.2, 0.5):
        budget = budget_between(prof, static, fraction)
        model = assets.tiny_model(family, seed=0, **layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        cfg = AdaccConfig(
            budget=budget, codecs=codecs, max_codec_error=0.5, head="full",
            run=RunFacts(optimizer="adamw_torch", mixed_precision="bf16"),
        )  # fmt: skip
        session = AdaccSession(model, cfg, profiles={shape_key(batch, False): prof})
        session.setup(batch)
        measure_step_peak(model, batch, opt, autocast=torch.bfloat16)  # optimizer states exist
        session.on_step_begin(1)
        assert session.schedule.is_tracking_step(1) and session.rectifier.tracker is not None
        peak = measure_step_peak(model, batch, opt, autocast=torch.bfloat16)
        assert peak.peak_nbytes <= budget, (fraction, peak.phases, budget)
        need = tracking_need(session.profile, session.policy)
        measured.append((len(session.rectifier.tracker.stats), need))
        session.close()
    assert measured[0][0] == 0, measured
    assert all(n > 0 for n, need in measured[1:] if need), measured
