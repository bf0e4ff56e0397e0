"""Compression touches only what backward reads: forward is exact, gradients are close."""

from __future__ import annotations

import pytest
import torch
from conftest import grad_rel_error, step

from adacc_hf import Action, Policy, apply_adacc, uniform_policy

# Upper bounds on ||g - g_ref|| / ||g_ref|| on the tiny random-init models when every op whose
# default codec is this one is compressed (measured: see docs/accuracy.md). Random-init tiny models
# are a worst case for INT4 (no averaging over wide layers); bitpack (dropout masks, kept through
# the runtime: see test_runtime_dropout.py) is lossless.
GRAD_ERROR_BOUND = {"int4_outlier": 0.35, "int4_channel": 0.25, "int4_asym": 0.25, "bitpack": 0.0}


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
    policy, n = _only(uniform_policy(model, "compress", batch), codec)
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
