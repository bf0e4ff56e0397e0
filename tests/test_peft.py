"""A PEFT LoRA model trains under a mixed policy and its LoRA weights get gradients."""

from __future__ import annotations

import pytest
import torch
from conftest import random_policy, step

from adacc_hf import Action, apply_adacc, assets
from adacc_hf.codecs import get_codec

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
    acts = policy.groups["block"].variants[0].actions
    masked = [o.key for o in policy.groups["block"].ops if o.key.startswith("self_attn/add")]
    acts[masked[-1]] = Action.compress("int4_asym")  # the scores plus the -inf causal mask
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
        # This mix compresses the -inf-masked attention scores: the codec keeps the -inf in
        # place (flagged rows, marker codes) at exactly its planned size, no exact copy.
        scores = [
            k for k, a in acts.items() if k.startswith("self_attn/add") and a.kind == "compress"
        ]
        assert scores and not handle.fallbacks
        for rt in handle.runtimes.values():
            for k in scores:
                op = policy.groups["block"].op(k)
                codec = get_codec(acts[k].codec, **dict(acts[k].params))
                assert rt.last_bytes[k] == codec.predict_nbytes(op.shape, torch.float32)
    assert any(g.abs().sum() > 0 for k, g in grads.items() if "lora_A" in k)
    assert losses[-1] < losses[0]
