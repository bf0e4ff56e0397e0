"""Adapters find every block and name the ops inside with layer types that pick codecs."""

from __future__ import annotations

import pytest

from adacc_hf import assets, get_adapter, supported_model_types, trace_model, uniform_policy
from adacc_hf.adapters.base import classify_attention_ops

EXPECTED_GROUPS = {
    "llama": {"block": 2},
    "gpt2": {"block": 2},
    "bert": {"block": 2},
    "t5": {"encoder_first": 1, "encoder": 1, "decoder_first": 1, "decoder": 1},
}


def test_every_block_is_found_and_grouped_by_structure(tiny, family):
    model, batch = tiny
    groups = get_adapter(model).block_groups(model)
    assert {g.name: len(g.modules) for g in groups} == EXPECTED_GROUPS[family]
    trace = trace_model(model, batch)
    assert set(trace.groups) == set(EXPECTED_GROUPS[family])


def test_ops_carry_the_layer_types_that_select_codecs(tiny, family):
    model, batch = tiny
    trace = trace_model(model, batch)
    for name, bt in trace.groups.items():
        types = {op.layer_type for op in bt.ops}
        assert {"norm", "qkv", "attn_scores", "attn_probs", "attn_out"} <= types, (name, types)
        if name in ("block", "encoder", "decoder", "encoder_first", "decoder_first"):
            assert {"mlp_up", "act", "mlp_down"} <= types, (name, types)
        probs = [op for op in bt.ops if op.layer_type == "attn_probs"]
        assert all("softmax" in op.key for op in probs)
        keys = [op.key for op in bt.ops]
        assert len(keys) == len(set(keys))


def test_decoder_blocks_have_cross_attention():
    model = assets.tiny_model("t5")
    trace = trace_model(model, assets.tiny_batch("t5", model))
    dec = {op.key.split("/")[0] for op in trace.groups["decoder"].ops}
    enc = {op.key.split("/")[0] for op in trace.groups["encoder"].ops}
    assert any(r.startswith("layer.1.EncDecAttention") for r in dec)
    assert not any("EncDecAttention" in r for r in enc)


def test_trace_leaves_rng_and_model_untouched(tiny):
    import torch

    model, batch = tiny
    model.eval()
    state = torch.get_rng_state()
    trace_model(model, batch)
    assert torch.equal(state, torch.get_rng_state())
    assert not any(m.training for m in model.modules())
    assert not any("_gradient_checkpointing_func" in vars(m) for m in model.modules())


def test_attention_op_classification_by_position():
    packets = ["mul", "cat", "bmm", "mul", "add", "_softmax", "mul", "bmm", "clone"]
    assert classify_attention_ops(packets) == [
        "qkv",
        "qkv",
        "attn_scores",
        "attn_scores",
        "attn_scores",
        "attn_probs",
        "attn_dropout",
        "attn_context",
        "attn_out",
    ]
    assert classify_attention_ops(["_scaled_dot_product_flash_attention", "clone"]) == [
        "attn_fused",
        "attn_out",
    ]


def test_supported_types_include_the_four_families_and_llama_relatives():
    assert {"llama", "gpt2", "t5", "bert", "mistral", "qwen2"} <= set(supported_model_types())
    with pytest.raises(ValueError, match="supported model types"):
        get_adapter("opt")


def test_dummy_batch_traces_without_user_data(family):
    policy = uniform_policy(assets.tiny_model(family), "recompute")
    assert policy.groups
