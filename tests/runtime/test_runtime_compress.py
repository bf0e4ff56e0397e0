"""Compression touches only what backward reads: forward is exact, gradients are close."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import grad_rel_error, step

from adacc_hf import Action, Policy, apply_adacc, uniform_policy
from adacc_hf.codecs import get_codec

# Upper bounds on ||g - g_ref|| / ||g_ref|| on the tiny random-init models when every op whose
# default codec is this one is compressed (measured: see docs/accuracy.md). Random-init tiny models
# are a worst case for INT4 (no averaging over wide layers); bitpack (dropout masks, kept through
# the runtime: see test_runtime_dropout.py) is lossless.
GRAD_ERROR_BOUND = {
    "int4_outlier": 0.35,
    "int4_channel": 0.25,
    "int4_asym": 0.25,
    "fp8_e4m3": 0.1,
    "bitpack": 0.0,
}
#: Q / K / V default to FP8; their INT4 codec (profiled beside it) is checked on them too.
LAYER_CODECS = {"int4_channel": {"qkv": "int4_channel"}}


def _only(policy: Policy, codec: str) -> tuple[Policy, int]:
    """Keep only the compress actions that use `codec`; recompute everything else."""
    n = 0
    for g in policy.groups.values():
        acts = g.variants[0].actions
        for k, a in acts.items():
            if a.kind == "compress" and a.codec == codec:
                n += 1
            else:
                acts[k] = Action.recompute()
    return policy, n


def test_compress_policy_keeps_forward_outputs_identical(tiny):
    model, batch = tiny
    ref_loss, _, ref_out = step(model, batch)
    with apply_adacc(model, uniform_policy(model, "compress", batch)) as handle:
        loss, grads, out = step(model, batch)
        assert sum(handle.cached_bytes().values()) > 0
    assert torch.equal(loss, ref_loss)
    assert torch.equal(out.logits, ref_out.logits)
    assert all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("codec", sorted(GRAD_ERROR_BOUND))
def test_gradient_error_is_bounded_per_codec(tiny, codec):
    model, batch = tiny
    _, ref_grads, _ = step(model, batch)
    policy = uniform_policy(model, "compress", batch, codecs=LAYER_CODECS.get(codec))
    policy, n = _only(policy, codec)
    if n == 0:
        pytest.skip(f"no op of this model uses {codec} by default")
    with apply_adacc(model, policy):
        _, grads, _ = step(model, batch)
    err = grad_rel_error(grads, ref_grads)
    assert err <= GRAD_ERROR_BOUND[codec], f"{codec}: {err:.4f}"
    if GRAD_ERROR_BOUND[codec] > 0:
        assert err > 0  # the codec really ran on the backward path


def test_naive_int4_everywhere_is_bounded_but_lossy(tiny):
    model, batch = tiny
    _, ref_grads, _ = step(model, batch)
    policy = uniform_policy(
        model,
        "compress",
        batch,
        codecs=dict.fromkeys(
            [
                "norm",
                "qkv",
                "attn_scores",
                "attn_probs",
                "attn_dropout",
                "attn_context",
                "attn_out",
                "mlp_up",
                "act",
                "mlp_down",
                "dropout",
                "elementwise",
            ],
            "int4_naive",
        ),
    )
    with apply_adacc(model, policy):
        _, grads, _ = step(model, batch)
    assert 0 < grad_rel_error(grads, ref_grads) < 0.4


def test_fp8_runs_end_to_end_through_profiler_runtime_and_tracking():
    """fp8_e4m3 (per-block scaled e4m3fn): profiled on the real activations, applied to every
    saved activation through the runtime at exactly its predicted size, re-measured on a
    tracking step; forward exact, gradients within fp8's error."""
    from conftest import grad_rel_error

    from adacc_hf import assets, profile_model
    from adacc_hf.evolution import OutlierTracker, apply_stats
    from adacc_hf.schema import CODEC_FOR_LAYER

    model = assets.tiny_model("llama", hidden_size=256, intermediate_size=512)
    batch = assets.tiny_batch("llama", model, batch_size=2, seq_len=32)
    _, ref_grads, ref_out = step(model, batch)
    prof = profile_model(model, batch, codecs=["fp8_e4m3"], repeats=2)
    fp8_ops = [o for g in prof.groups.values() for o in g.ops if "fp8_e4m3" in o.codecs]
    assert fp8_ops and all(o.codecs["fp8_e4m3"].rel_error < 0.05 for o in fp8_ops)
    policy = uniform_policy(
        model, "compress", batch, codecs=dict.fromkeys(CODEC_FOR_LAYER, "fp8_e4m3")
    )
    fp8 = get_codec("fp8_e4m3")
    with apply_adacc(model, policy) as handle:
        step(model, batch)
        for op in fp8_ops:  # tracking measures only codecs faster than their op's recompute,
            op.codecs["fp8_e4m3"].encode_ms = op.codecs["fp8_e4m3"].decode_ms = 0.0  # timed as free
        tracker = OutlierTracker(prof)
        assert tracker.codecs
        handle.set_tracker(tracker)
        _, grads, out = step(model, batch)
        handle.set_tracker(None)
        for rt in handle.runtimes.values():
            for key, nbytes in rt.last_bytes.items():
                op = policy.groups[rt.group].op(key)
                if rt.actions[key].codec == "fp8_e4m3":
                    main = math.prod(op.shape) * 4
                    assert nbytes == fp8.predict_nbytes(op.shape, torch.float32) + op.nbytes - main
    assert torch.equal(out.logits, ref_out.logits)
    assert 0 < grad_rel_error(grads, ref_grads) < 0.05
    new_prof, _ = apply_stats(prof, tracker.stats)
    assert any(k[2] == "fp8_e4m3" for k in tracker.stats)
    assert new_prof.groups.keys() == prof.groups.keys()
