"""The step peak: its measurement against arithmetic, the static model's optimizer temporaries
against measurement, `auto` budgets, mixed precision and masked attention scores."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import TrainingArguments

from adacc_hf import apply_adacc, assets, measure_step_peak, prepare, profile_model, uniform_policy
from adacc_hf.codecs import get_codec, relative_error
from adacc_hf.engine.config import AdaccConfig
from adacc_hf.engine.facts import RunFacts
from adacc_hf.engine.session import AdaccSession
from adacc_hf.errors import BudgetError
from adacc_hf.runtime.peak import AllocationTracker, live_state_nbytes
from adacc_hf.solver import budget as budget_mod
from adacc_hf.solver import budget_between, estimate_static_memory, min_budget, parse_budget, solve

KiB = 1024


class Allocates(torch.nn.Module):
    """A model whose step allocates known sizes: forward keeps `a` (4 KiB) and a 2 KiB result, a
    temporary of 8 KiB lives only inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(256))  # 1 KiB

    def forward(self, x):
        tmp = torch.ones(2048)  # 8 KiB, freed before forward returns
        a = x * self.w.repeat(4)  # 4 KiB, saved for backward (by the mul below)
        b = (a * a).sum() + tmp.sum() * 0
        del tmp
        return {"loss": b}


def test_tracker_sees_every_allocation_and_free():
    t = AllocationTracker()
    with t:
        x = torch.empty(1000, dtype=torch.uint8)
        t.mark("a")
        y = torch.empty(3000, dtype=torch.uint8)
        del y
        t.mark("b")
        z = torch.empty(100, dtype=torch.uint8)
    assert (t.level("a"), t.level("b"), t.peak("a", "b"), t.peak("b"), t.peak_nbytes) == (
        1000,
        1000,
        4000,
        1100,
        4000,
    )
    del x, z


def test_step_peak_is_the_baseline_plus_the_highest_allocation():
    model = Allocates()
    batch = {"x": torch.ones(1024)}  # 4 KiB
    peak = measure_step_peak(model, batch)
    assert peak.baseline_nbytes == 1 * KiB + 4 * KiB  # the parameter and the batch
    # Forward holds the 8 KiB temporary next to `a` (4 KiB) and the repeated weight (4 KiB).
    assert peak.phases["forward"] >= peak.baseline_nbytes + 16 * KiB
    assert peak.peak_nbytes == max(peak.phases.values())


@pytest.mark.parametrize(
    "optim", ["adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "adamw_bnb_8bit"]
)
def test_static_model_predicts_the_optimizer_step(optim):
    """Parameters + gradients + states + the optimizer's own temporaries (the static model)
    against the optimizer phase of a measured step, with the Trainer's optimizer."""
    if "bnb" in optim:
        pytest.importorskip("bitsandbytes")
    from transformers import Trainer

    model = assets.tiny_model("llama")
    batch = assets.tiny_batch("llama", model)
    args = TrainingArguments(
        output_dir="/tmp/adacc-opt", optim=optim, use_cpu=True, report_to="none", weight_decay=0.01
    )
    opt = Trainer(model=model, args=args).create_optimizer()
    measure_step_peak(model, batch, opt)  # the states exist
    measured = measure_step_peak(model, batch, opt).phases["optimizer"]
    est = estimate_static_memory(model, optimizer=optim)
    predicted = (
        est.resident
        + est.grads
        + est.optimizer_step
        + sum(v.numel() * v.element_size() for v in batch.values())
    )
    # Never below the measurement; above it by at most a few percent (rules keep the larger
    # multiple where measurements differed).
    assert measured <= predicted <= 1.05 * measured, (measured, predicted)


def test_auto_budget_counts_the_resident_model_once(monkeypatch):
    total, free = 8 * 2**30, 3 * 2**30
    monkeypatch.setattr(budget_mod, "device_memory", lambda device=None: (total, free))
    model = assets.tiny_model("llama")
    resident = live_state_nbytes(model)
    margin = budget_mod.auto_margin_nbytes(total)
    assert parse_budget("auto", "cpu", resident) == free + resident - margin
    assert parse_budget("auto", "cpu") == free - margin


def test_masked_scores_are_judged_on_what_the_mask_leaves_visible():
    scores = torch.randn(4, 4, 32, 32)
    masked = scores.masked_fill(
        torch.ones(32, 32, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min
    )
    codec = get_codec("int4_channel")
    ruined = float(relative_error(masked, codec.decode(codec.encode(masked))))
    plain = float(relative_error(scores, codec.decode(codec.encode(scores))))
    assert plain < 0.2 < 0.5 < ruined  # the sentinels' column scales wipe out the visible scores


@pytest.mark.slow  # 30 s; the sentinel rule itself is tested on a tensor just above
def test_t5_masked_scores_are_never_compressed():
    """T5's masked attention scores carry finfo.min: no codec is profiled for them, so no budget
    makes the solver compress them, while the unmasked scores can be."""
    model = assets.tiny_model("t5")
    batch = assets.tiny_batch("t5", model, batch_size=4, seq_len=32)
    codecs = ["int4_asym", "int4_channel", "int4_naive", "int4_outlier"]
    prof = profile_model(model, batch, repeats=1, codecs=codecs)
    masked = {
        (g.name, o.key)
        for g in prof.groups.values()
        for o in g.ops
        if o.layer_type == "attn_scores" and o.key.split("/")[1].startswith("add")
    }
    assert masked
    for name, key in masked:
        assert not next(o for o in prof.groups[name].ops if o.key == key).codecs
    static = estimate_static_memory(model, optimizer="sgd")
    for fraction in (0.1, 0.3, 0.6):
        sol = solve(
            prof, budget_between(prof, static, fraction), static_nbytes=static, codecs=codecs
        )
        for name, key in masked:
            for v in sol.policy.groups[name].variants:
                assert v.action(key).kind != "compress"


def test_t5_memory_between_encoder_and_decoder_is_in_the_prediction():
    """T5's backward peaks between the decoder's last block and the encoder's (the decoder's
    embeddings, the encoder's final norm), where no block runs: with encoder blocks held whole
    (no checkpointing) that moment was 1.2 % above the predicted step peak."""
    model = assets.tiny_model("t5", seed=0, num_layers=4, num_decoder_layers=4)
    batch = assets.tiny_batch("t5", model)
    prof = profile_model(model, batch, repeats=1)
    static = estimate_static_memory(model, optimizer="sgd")
    budget = budget_between(prof, static, 1.0)  # no checkpointing anywhere
    sol = solve(prof, budget, static_nbytes=static)
    assert not any(v.checkpoint for g in sol.policy.groups.values() for v in g.variants)
    model.train()
    with apply_adacc(model, sol.policy):
        peak = measure_step_peak(model, batch, torch.optim.SGD(model.parameters(), lr=0.0))
    assert peak.peak_nbytes <= sol.peak_nbytes <= budget, (peak, sol.peak_nbytes)
    assert sol.peak_nbytes - peak.peak_nbytes <= 0.05 * peak.peak_nbytes


def test_bf16_custom_loop_profiles_under_its_autocast(caplog):
    """A custom loop with ``torch.autocast`` around the forward: the session sees the autocast
    from its hook, profiles under it, and no op of the run is unknown to the policy."""
    model = assets.tiny_model("llama")
    batch = assets.tiny_batch("llama", model, batch_size=4, seq_len=32)
    static = estimate_static_memory(model, optimizer="sgd", mixed_precision="bf16")
    prof = profile_model(model, batch, repeats=1, autocast=torch.bfloat16)
    session = prepare(model, budget_between(prof, static, 0.5), optimizer="sgd", adaptive=False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with caplog.at_level(logging.WARNING, logger="adacc_hf"):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert session.autocast == torch.bfloat16
    assert session.profile.autocast == str(torch.bfloat16)
    assert not session.handle.unknown_ops and "not in the policy" not in caplog.text
    assert any(o.dtype == "torch.bfloat16" for o in session.profile.groups["block"].ops)
    session.close()


def test_a_longer_batch_the_budget_cannot_hold_runs_full_recompute_with_a_warning(caplog):
    """Mid-run, a batch longer than any planned one that no policy fits in the budget runs with
    full recomputation (the least memory) and one warning naming the fix; with ``max_seq_len``
    the same budget is refused before the first step."""
    model = assets.tiny_model("llama")
    short = assets.tiny_batch("llama", model, batch_size=4, seq_len=32)
    long = assets.tiny_batch("llama", model, batch_size=4, seq_len=256)
    static = estimate_static_memory(model, optimizer="sgd")
    prof, prof_long = profile_model(model, short, repeats=1), profile_model(model, long, repeats=1)
    budget = budget_between(prof, static, 0.5)
    assert min_budget(prof_long, static) > budget  # the long batch fits no policy
    session = prepare(model, budget, optimizer="sgd", adaptive=False)
    with caplog.at_level(logging.WARNING, logger="adacc_hf"):
        for batch in (short, long, long):
            model(**batch).loss.backward()
    assert caplog.text.count("does not fit the budget") == 1
    assert "max_seq_len" in caplog.text
    assert session.policy.metadata["source"] == "least_memory"
    assert {
        a.kind for v in session.policy.groups["block"].variants for a in v.actions.values()
    } <= {"recompute"}
    session.close()
    session = prepare(model, budget, optimizer="sgd", adaptive=False, max_seq_len=256)
    with pytest.raises(BudgetError, match="budget"):
        model(**short)
    session.close()


@pytest.mark.parametrize("family", ["gpt2", "llama", pytest.param("t5", marks=pytest.mark.slow)])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_gradient_accumulation_steps_peak_within_the_prediction(family, autocast):
    """In a later micro-batch every gradient of the first is alive through backward: the step
    model adds those not yet computed when each block's backward starts in the profiled step
    (embeddings' come last; GPT-2's position embeddings have no head share), so full
    recomputation's measured two-micro-batch step stays within its prediction, and near it. The
    two micro-batches are distinct tensors, alive all step as the Trainer's ``get_batch_samples``
    holds them (one batch counted put a bf16 accumulating loop 2,890 bytes over its budget)."""
    from adacc_hf.solver import predict

    layers = {"gpt2": {"n_layer": 4}, "t5": {"num_layers": 2, "num_decoder_layers": 2}}
    model = assets.tiny_model(family, seed=0, **layers.get(family, {"num_hidden_layers": 4}))
    batch = assets.tiny_batch(family, model, batch_size=4, seq_len=64)
    mp = "bf16" if autocast is not None else None
    static = estimate_static_memory(model, optimizer="adamw_torch", mixed_precision=mp)
    prof = profile_model(model, batch, repeats=1, autocast=autocast)
    policy = uniform_policy(model, "recompute", batch, autocast=autocast)
    predicted = predict(prof, policy, static, 2, measured_ms=False).peak_nbytes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    micro = [batch, {k: v.clone() for k, v in batch.items()}]
    with apply_adacc(model, policy):
        measure_step_peak(model, micro, opt, autocast=autocast)  # states exist
        peak = measure_step_peak(model, micro, opt, autocast=autocast)
    assert peak.peak_nbytes <= predicted, (peak.phases, predicted)
    assert peak.peak_nbytes >= 0.97 * predicted, (peak.phases, predicted)


def test_an_accumulating_step_holds_every_micro_batch_and_is_predicted_to_the_byte():
    """The Trainer fetches a step's micro-batches before its first forward
    (``get_batch_samples``): all of them are alive all step. A session planned with no headroom
    predicts the measured peak of such a step (fp32, two distinct micro-batches) to the byte; it
    counted one micro-batch before, 3,072 bytes under here."""
    model = assets.tiny_model("llama", vocab_size=1000, num_hidden_layers=4)
    g = torch.Generator().manual_seed(0)

    def batch() -> dict:
        ids = torch.randint(3, 1000, (2, 64), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    static = estimate_static_memory(model, optimizer="adamw_torch")
    budget = budget_between(profile_model(model, batch(), repeats=1), static, 0.3, accumulation=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    session = prepare(
        model, budget, optimizer="adamw_torch", adaptive=False, gradient_accumulation_steps=2,
        headroom=0.0, profile_repeats=1,
    )  # fmt: skip
    try:
        micro = [batch(), batch()]
        for b in micro:
            (model(**b).loss / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        predicted = session.policy.metadata["predicted"]["peak_nbytes"]
        peak = measure_step_peak(model, micro, opt).peak_nbytes
        assert peak == predicted <= budget, (peak, predicted, budget)
    finally:
        session.close()


def test_a_session_planning_inside_the_callers_autocast_region_measures_the_real_backward():
    """A custom loop calls the model under its own ``torch.autocast``: the session profiles in the
    forward pre-hook, inside that region, where torch keeps every weight cast until the region
    exits. The loop's backward runs outside it (each block's casts go after its recompute); the
    profiled backward must too, or T5's plan (bf16) counts every block's casts at once (262,144
    bytes, 8 % of its step, over-predicted: budgets that fit were refused). Here the session's
    profile equals one taken outside the region, and the step's measured peak is its
    prediction's, within the budget."""
    model = assets.tiny_model("t5", seed=0, num_layers=2, num_decoder_layers=2)
    batch = assets.tiny_batch("t5", model, batch_size=2, seq_len=32)
    static = estimate_static_memory(model, optimizer="adamw_torch", mixed_precision="bf16")
    alone = profile_model(model, batch, repeats=1, autocast=torch.bfloat16)
    budget = budget_between(alone, static, 0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    session = prepare(model, budget, optimizer="adamw_torch", adaptive=False, profile_repeats=1)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
            # the caller's region is back as it was, its nesting level included
            assert torch.is_autocast_enabled("cpu")
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
            assert torch.autocast_increment_nesting() == 2
            torch.autocast_decrement_nesting()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        planned = session.current.profile.timeline
        assert planned.backward_start == alone.timeline.backward_start
        assert planned.tail_peak == alone.timeline.tail_peak
        assert min_budget(session.current.profile, static) == min_budget(alone, static)
        predicted = session.policy.metadata["predicted"]["peak_nbytes"]
        peak = measure_step_peak(model, batch, opt, autocast=torch.bfloat16).peak_nbytes
        assert peak <= budget, (peak, budget)
        assert peak <= predicted <= peak * 1.01, (peak, predicted)
        assert not torch.is_autocast_enabled("cpu")
    finally:
        session.close()


def test_kept_dropout_masks_hold_their_generator_state_in_the_prediction():
    """A checkpointed block that keeps a dropout mask keeps, beside it, the CPU generator state
    replay restores (5,056 bytes per random fill: CPU dropout fills its mask twice). A session's
    plan (its action tables measured) is predicted to the byte against the measured step peak
    where it keeps a mask; before, 24 states on gpt2-cpu at 4 x 256 (118.5 KiB) put a plan at its
    budget 121,344 bytes over it."""
    model = assets.tiny_model("gpt2", seed=0, n_layer=4)
    batch = assets.tiny_batch("gpt2", model, batch_size=4, seq_len=64)
    batch["labels"] = batch["input_ids"]
    probes: dict = {}
    prof = profile_model(model, batch, repeats=1, probes=probes)
    for g in prof.groups.values():  # keeping a mask pays whatever the CPU's timings
        g.dispatch_ms = 0.0
        for o in g.ops:
            for c in o.codecs.values() if o.mask else ():
                c.encode_ms = c.decode_ms = 0.0
    masks = {o.key for g in prof.groups.values() for o in g.ops if o.mask}
    assert masks
    assert all(
        o.rng_nbytes == 5056 * o.rng_states > 0
        for g in prof.groups.values()
        for o in g.ops
        if o.mask
    )
    static = estimate_static_memory(model, optimizer="adamw_torch")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    measure_step_peak(model, batch, opt)  # optimizer states exist
    keeping = 0
    for fraction in (0.6, 0.9):
        budget = budget_between(prof, static, fraction)
        config = AdaccConfig(budget=budget, adaptive=False, run=RunFacts(optimizer="adamw_torch"))
        policy = AdaccSession(model, config).solver.solve_measured(copy.deepcopy(prof), probes)
        session = AdaccSession(model, config, policy=policy)
        session.setup(batch)
        try:
            measured = measure_step_peak(model, batch, opt).peak_nbytes
        finally:
            session.close()
        policy = session.policy
        kept = {
            k
            for g in policy.groups.values()
            for v in g.variants
            if v.checkpoint and v.count
            for k, a in v.actions.items()
            if a.kind != "recompute"
        }
        keeping += bool(kept & masks)
        predicted = policy.metadata["predicted"]["peak_nbytes"]
        assert measured == predicted <= budget, (fraction, measured - predicted, budget - measured)
    assert keeping, "no plan kept a dropout mask: the test would not test it"


def test_a_batch_counts_each_storage_once_and_only_the_rows_it_spans():
    """``labels`` sharing ``input_ids``' storage counts once; a micro-batch sliced out of a larger
    sample counts its rows (a run's collated batches hold only those), not the sample's storage:
    the automatic micro-batch planned a 2-row candidate with the 8-row sample's bytes, times its
    accumulation of 4."""
    from adacc_hf.runtime.peak import batch_nbytes

    ids = torch.zeros(8, 48, dtype=torch.long)
    assert batch_nbytes([ids, ids]) == 8 * 48 * 8
    assert batch_nbytes([ids[:2], ids[:2], torch.ones(2, 48)]) == 2 * 48 * 8 + 2 * 48 * 4
