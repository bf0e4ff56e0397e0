"""A PEFT LoRA model trains under a mixed policy and its LoRA weights get gradients."""

from __future__ import annotations

import pytest
import torch
from conftest import random_policy, step

from adacc_hf import apply_adacc, assets

peft = pytest.importorskip("peft")


def _lora(seed=0):
    model = assets.tiny_model("llama", seed=seed)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    return peft.get_peft_model(model, config)


def test_lora_gradients_are_exact_under_retain_recompute_mix():
    model = _lora()
    batch = assets.tiny_batch("llama", assets.tiny_config("llama"))
    ref_loss, ref_grads, _ = step(model, batch)
    assert any("lora_A" in k for k in ref_grads) and not any("embed" in k for k in ref_grads)
    policy = random_policy(model, batch, seed=7)
    assert any(op.key.startswith("self_attn.q_proj.lora") for op in policy.groups["block"].ops)
    with apply_adacc(model, policy):
        loss, grads, _ = step(model, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)


def test_lora_trains_with_a_mixed_compress_policy():
    model = _lora()
    batch = assets.tiny_batch("llama", assets.tiny_config("llama"))
    policy = random_policy(model, batch, seed=8, kinds=("retain", "recompute", "compress"))
    assert "compress" in str(policy.summary())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    with apply_adacc(model, policy) as handle:
        for _ in range(8):
            loss, grads, _ = step(model, batch)
            lora = [g for k, g in grads.items() if "lora_B" in k]
            assert lora and all(torch.isfinite(g).all() for g in lora)
            opt.step()
            losses.append(loss.item())
        # This mix compresses the -inf-masked attention scores: the runtime keeps those exact.
        assert any(k.startswith("self_attn/add") for k in handle.fallbacks)
    assert any(g.abs().sum() > 0 for k, g in grads.items() if "lora_A" in k)
    assert losses[-1] < losses[0]
