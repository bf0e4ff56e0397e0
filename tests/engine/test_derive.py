"""A later bucket's memory interpolated between the tiny bucket and a measured bucket that contains
it (`profiler.derive`), against independent truth: the profile measured at that bucket, and the
real step's peak (every allocation of the CPU allocator, `measure_step_peak`) under policies
solved on the interpolated profile. SDPA (llama), eager attention with its quadratic scores (gpt2)
and an encoder-decoder with two lengths (t5)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from adacc_hf import apply_adacc, assets, measure_step_peak, profile_model
from adacc_hf.engine.shapes import padded, shape_key, tiny_batch, tiny_key
from adacc_hf.profiler.derive import (
    GROUP_BYTES,
    PROFILE_BYTES,
    SLACK,
    chord_excess,
    interpolate_memory,
    length_share,
    ratio,
)
from adacc_hf.solver import budget_between, estimate_static_memory, solve

pytestmark = pytest.mark.usefixtures("one_thread")


def masked(batch: dict) -> dict:
    """`batch` with its last position padded (the masked attention path dynamic padding takes)."""
    out = dict(batch)
    for k in ("attention_mask", "decoder_attention_mask"):
        if k in out:
            out[k] = out[k].clone()
            out[k][:, -1] = 0
    if "labels" in out:
        out["labels"] = out["labels"].clone()
        out["labels"][:, -1] = -100
    return out


def fields_under(derived, measured) -> list[str]:
    """Every memory field where the interpolation counts less than the measurement."""
    under = []
    for name, g in measured.groups.items():
        for f in GROUP_BYTES:
            if getattr(derived.groups[name], f) < getattr(g, f):
                under.append(f"{name}.{f}")
    under += [f for f in PROFILE_BYTES if getattr(derived, f) < getattr(measured, f)]
    for f in dataclasses.fields(measured.timeline):
        a, b = getattr(derived.timeline, f.name), getattr(measured.timeline, f.name)
        if (a < b) if isinstance(b, int) else any(x < y for x, y in zip(a, b, strict=True)):
            under.append(f"timeline.{f.name}")
    for k, h in measured.heads.items():
        d = derived.heads[k]
        if (d.held, d.forward_peak, d.backward_peak) < (h.held, h.forward_peak, h.backward_peak):
            under.append(f"heads.{k}")
    return under


@pytest.mark.parametrize(
    ("family", "rows"),
    [
        ("llama", 4),
        ("llama", 3),
        ("gpt2", 4),
        ("gpt2", 3),
        ("t5", 4),
        pytest.param("t5", 3, marks=pytest.mark.slow),  # 20 s; t5 at 4 rows covers its two lengths
    ],
)
def test_interpolated_memory_never_under_counts_and_predicts_the_real_step(family, rows):
    """A shorter bucket of the run's micro-batch (dynamic padding), and one of fewer rows too (a
    last, smaller batch: what one row holds broadcast over the batch is then counted whole)."""
    model = assets.tiny_model(family, seed=0)
    enc_dec = bool(model.config.is_encoder_decoder)
    big = masked(assets.tiny_batch(family, model, batch_size=4, seq_len=64))
    small = masked(assets.tiny_batch(family, model, batch_size=rows, seq_len=40))
    outer_key, key = shape_key(big, enc_dec), shape_key(small, enc_dec)
    pad = model.config.pad_token_id
    outer = profile_model(model, big, repeats=1)
    tiny = profile_model(model, tiny_batch(big, outer_key, pad), repeats=1, reference=outer)
    edge = padded(small, key, pad)  # the bucket is planned at its edge
    measured = profile_model(model, edge, repeats=1, reference=outer)
    derived = profile_model(model, edge, repeats=1, reference=outer, memory=False)
    shapes = (tiny_key(key)[:-1], outer_key[:-1], key[:-1])
    tokens = [k[0] * sum(k[1:-1]) for k in (key, outer_key)]
    interpolate_memory(
        derived, tiny, outer, ratio(*shapes), tokens[0] / tokens[1], length_share(*shapes)
    )
    assert fields_under(derived, measured) == []

    static = estimate_static_memory(model, optimizer="sgd")
    model.train()
    seen = []
    for fraction in (0.0, 0.5, 1.0):
        sol = solve(derived, budget_between(derived, static, fraction), static_nbytes=static)
        with apply_adacc(model, sol.policy):
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            peak = measure_step_peak(model, edge, opt).peak_nbytes
        seen.append((fraction, peak, sol.peak_nbytes, round(sol.peak_nbytes / peak - 1, 3)))
    print(family, seen)
    # Never below the real step; above it by what the chord over-counts where the step's peak
    # moment at the tiny bucket is another than at the outer one: on these 1-2 MB models the
    # parameter gradients are a large share (measured: llama and gpt2 10-12 % over, t5 22-26 %
    # where its decoder moved more than its encoder; with a row fewer, where one-row tensors count
    # whole, 27-49 %; on SmolLM2: `benchmarks/profile_breakdown.py`).
    bound = 1.3 if rows == 4 else 1.6
    assert all(peak <= pred <= bound * peak for _, peak, pred, _ in seen), seen


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_the_chord_excess_is_what_the_chord_over_counts_a_plain_block_by(dropout):
    """`chord_excess`, from the ops traced at the three shapes, against the memory pass: what a
    plain block holds (`full_nbytes`, measured at 4 x 16, 4 x 32 and 4 x 64) is over-counted by
    the chord through 16 and 64 by exactly the excess per block (and `SLACK`). With attention
    dropout, SDPA runs its math path, whose scores, softmax and dropout grow with length squared;
    without, its fused kernel holds nothing quadratic: no excess."""
    model = assets.tiny_model("llama", seed=0, attention_dropout=dropout)
    b = {n: assets.tiny_batch("llama", model, batch_size=4, seq_len=n) for n in (16, 32, 64)}
    low, near = profile_model(model, b[16], repeats=1), profile_model(model, b[64], repeats=1)
    measured = profile_model(model, b[32], repeats=1, reference=near)
    derived = profile_model(model, b[32], repeats=1, reference=near, memory=False)
    shapes = ((4, 16), (4, 64), (4, 32))
    r, length = ratio(*shapes), length_share(*shapes)
    excess = chord_excess(low, near, derived, r, length)
    interpolate_memory(derived, low, near, r, 0.5, length)
    g, m = derived.groups["block"], measured.groups["block"]
    assert g.full_nbytes - m.full_nbytes - SLACK == excess // g.num_blocks
    assert (excess > 0) == (dropout > 0), excess


def test_later_buckets_are_interpolated_and_a_step_that_disproves_one_measures_it():
    """Under `prepare`: the run's first (longest) bucket is measured, a shorter one takes its
    memory from it and the tiny bucket, and a step that allocates more than that bucket's
    prediction (the device's counter, read here from a stand-in reporting 1 TB) has it profiled
    in full before its next batch."""
    from test_first_step import budget_for, longest, model, pad_collate, rows

    from adacc_hf import prepare
    from adacc_hf.engine.guard import DerivedCheck

    # without attention dropout SDPA runs its fused kernel: nothing grows with length squared, so
    # the chord is tight and the bucket interpolated (with it, the math path's scores have the
    # bucket measured: test_the_chord_excess_is_what_the_chord_over_counts_a_plain_block_by)
    m = model(attention_dropout=0.0)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    session = prepare(m, budget_for(m, "full", 0.5), optimizer=opt, adaptive=False)
    reads: list[int] = []
    session.ctx.derived_check = DerivedCheck(
        lambda d: reads.append(0), lambda w, keep=True: 1 << 40
    )
    short = pad_collate(rows(8)[1:2] * 4)  # 4 x 24
    for step, batch in enumerate([longest(), short, short], start=1):
        m(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 2:
            key = session.current.key
            assert session.profile.memory_from == ["1 x 8", "4 x 128"]
        session.step_done(step)
    assert len(reads) == 1  # only the interpolated bucket's first step was watched
    assert key in session.store.full_memory
    assert session.profiles[key].memory_from == []  # measured at its next batch
    session.close()
