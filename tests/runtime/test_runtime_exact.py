"""Retain / recompute policies change where activations live, never the numbers."""

from __future__ import annotations

import pytest
import torch
from conftest import random_policy, step

from adacc_hf import (
    apply_adacc,
    attention_recompute_policy,
    layer_type_policy,
    uniform_policy,
)
from adacc_hf.adapters import ATTENTION_CORE

MLP = {"mlp_up": "recompute", "act": "recompute", "mlp_down": "recompute"}


def _policies(model, batch):
    return {
        "all_retain": uniform_policy(model, "retain", batch),
        "full_recompute": uniform_policy(model, "recompute", batch),
        "attention_core": attention_recompute_policy(model, batch),
        "mlp_only": layer_type_policy(model, MLP, batch),
        "random_mix_0": random_policy(model, batch, seed=0),
        "random_mix_1": random_policy(model, batch, seed=1),
    }


def test_retain_and_recompute_policies_give_bitwise_equal_loss_and_gradients(tiny):
    model, batch = tiny
    ref_loss, ref_grads, ref_out = step(model, batch)
    for name, policy in _policies(model, batch).items():
        with apply_adacc(model, policy) as handle:
            loss, grads, out = step(model, batch)
        assert not handle.unknown_ops, name
        assert torch.equal(loss, ref_loss), name
        assert torch.equal(out.logits, ref_out.logits), name
        assert grads.keys() == ref_grads.keys(), name
        for k in ref_grads:
            assert torch.equal(grads[k], ref_grads[k]), f"{name}: {k}"


def test_policies_really_recompute_and_retain(tiny):
    """The exactness above is not vacuous: recomputed ops are not cached, retained ones are."""
    model, batch = tiny
    full = uniform_policy(model, "recompute", batch)
    core = attention_recompute_policy(model, batch)
    with apply_adacc(model, full) as handle:
        step(model, batch)
        assert handle.runtimes and all(b == 0 for b in handle.cached_bytes().values())
    with apply_adacc(model, core) as handle:
        step(model, batch)
        assert all(b > 0 for b in handle.cached_bytes().values())
    for g in core.groups.values():
        kinds = {g.op(k).layer_type: a.kind for k, a in g.variants[0].actions.items()}
        assert all(kinds[t] == "recompute" for t in ATTENTION_CORE if t in kinds)


def test_all_retain_runs_without_checkpoint_machinery(tiny):
    model, batch = tiny
    with apply_adacc(model, uniform_policy(model, "retain", batch)) as handle:
        assert handle.runtimes == {}
        blocks = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
        assert all("_gradient_checkpointing_func" not in vars(b) for b in blocks)


def test_dropout_is_active_so_rng_replay_is_tested(tiny):
    model, batch = tiny
    torch.manual_seed(0)
    a = model(**batch).loss
    torch.manual_seed(1)
    b = model(**batch).loss
    assert not torch.equal(a, b)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_llama_relatives_run_exactly(model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    from adacc_hf import assets

    base = assets.tiny_config("llama").to_dict()
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "attention_dropout",
        "use_cache",
    )
    config = AutoConfig.for_model(model_type, **{k: base[k] for k in keep})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    batch = assets.tiny_batch("llama", assets.tiny_config("llama"))
    ref_loss, ref_grads, _ = step(model, batch)
    policy = random_policy(model, batch, seed=3)
    with apply_adacc(model, policy):
        loss, grads, _ = step(model, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
