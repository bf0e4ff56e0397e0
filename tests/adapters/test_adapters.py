"""Adapters find every block and name the ops inside with layer types that pick codecs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from adacc_hf import (
    UnsupportedModelError,
    assets,
    get_adapter,
    supported_model_types,
    trace_model,
    uniform_policy,
)
from adacc_hf.adapters.base import classify_attention_ops, classify_experts_ops

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
    assert {"llama", "gpt2", "t5", "bert", "mistral", "qwen2", "opt"} <= set(
        supported_model_types()
    )
    assert get_adapter("t5").name == "t5" and get_adapter("opt").name == "generic"


def test_a_model_without_checkpointable_blocks_gets_an_error_saying_what_to_change():
    class Plain(nn.Module):
        config = SimpleNamespace(model_type="plain")

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

    with pytest.raises(UnsupportedModelError, match="GradientCheckpointingLayer") as e:
        get_adapter(Plain())
    assert "llama" in str(e.value)  # names what is supported


@pytest.mark.parametrize(
    ("family", "key", "layer_type"),
    [
        # the same names mean different things by where they sit
        ("gpt2", "attn.c_proj/addmm#0", "attn_out"),
        ("gpt2", "mlp.c_proj/addmm#0", "mlp_down"),
        ("gpt2", "attn/_safe_softmax#0", "attn_probs"),
        ("bert", "attention.output.dense/addmm#0", "attn_out"),
        ("bert", "intermediate.dense/addmm#0", "mlp_up"),
        ("bert", "output.dense/addmm#0", "mlp_down"),
        ("bert", "output.LayerNorm/native_layer_norm#0", "norm"),
        ("llama", "self_attn.q_proj/mm#0", "qkv"),
        ("llama", "mlp.act_fn/silu#0", "act"),
        ("llama", "mlp/mul#0", "elementwise"),  # act(gate) * up runs in the MLP's own code
    ],
)
def test_generic_rules_type_ops_by_name_class_and_place(family, key, layer_type):
    model = assets.tiny_model(family)
    trace = trace_model(model, assets.tiny_batch(family, model))
    types = {op.key: op.layer_type for op in trace.groups["block"].ops}
    assert types[key] == layer_type


def test_t5_position_bias_is_scored_as_attention():
    model = assets.tiny_model("t5")
    trace = trace_model(model, assets.tiny_batch("t5", model))
    ops = trace.groups["encoder_first"].ops
    bias = [o for o in ops if "relative_attention_bias" in o.key]
    assert bias and all(o.layer_type == "attn_scores" for o in bias)


def test_fused_experts_matmuls_alternate_up_and_down():
    packets = ["sort", "index", "histc", "_grouped_mm", "silu", "mul", "_grouped_mm", "mul"]
    assert classify_experts_ops(packets) == [
        "elementwise",
        "elementwise",
        "elementwise",
        "mlp_up",
        "elementwise",
        "elementwise",
        "mlp_down",
        "elementwise",
    ]


def test_dummy_batch_traces_without_user_data(family):
    policy = uniform_policy(assets.tiny_model(family), "recompute")
    assert policy.groups


# ------------------------------------------------------------------ plain PyTorch models
class _Mix(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = (
            nn.Linear(width, 2 * width),
            nn.GELU(),
            nn.Linear(2 * width, width),
        )

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class _Other(_Mix):
    pass


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.ModuleList([_Mix(), _Mix()])
        self.dec = nn.ModuleDict({"a": _Other(), "b": _Other()})

    def forward(self, x):
        for m in [*self.enc, *self.dec.values()]:
            x = m(x)
        return x.square().mean()


def test_plain_blocks_by_pattern_container_or_list_resolve_alike():
    from adacc_hf.adapters import plain

    model = _Stack()
    want = ["enc.0", "enc.1"]
    assert plain.resolve_blocks(model, "enc.*") == want  # `*` is one path component
    assert plain.resolve_blocks(model, model.enc) == want
    assert plain.resolve_blocks(model, [model.enc[1], "enc.0"]) == want
    assert plain.resolve_blocks(model, ["enc.*", "dec.*"]) == [*want, "dec.a", "dec.b"]
    assert plain.resolve_blocks(model, "enc") == want  # a list names its blocks
    with pytest.raises(UnsupportedModelError, match="matches no module.*'enc.\\*' or 'dec.\\*'"):
        plain.resolve_blocks(model, "layers.*")
    with pytest.raises(UnsupportedModelError, match="inside another block"):
        plain.resolve_blocks(model, ["enc.*", "enc.0.fc1"])


def test_plain_blocks_group_by_class_and_are_typed_by_the_generic_rules():
    import torch

    from adacc_hf.adapters import PlainAdapter, plain

    model = _Stack()
    plain.register(model, ["enc.*", "dec.*"])
    try:
        adapter = get_adapter(model)
        assert isinstance(adapter, PlainAdapter) and adapter.model_type(model) == "plain:_Stack"
        groups = {g.name: g.paths for g in adapter.block_groups(model)}
        assert groups == {"mix": ["enc.0", "enc.1"], "other": ["dec.a", "dec.b"]}
        trace = trace_model(model, {"x": torch.randn(2, 4, 8)})
        types = {o.key: o.layer_type for o in trace.groups["mix"].ops}
        assert types["fc1/addmm#0"] == "mlp_up" and types["act/gelu#0"] == "act"
        assert types["fc2/addmm#0"] == "mlp_down"
    finally:
        plain.unregister(model)
    with pytest.raises(UnsupportedModelError, match="blocks="):
        get_adapter(model)  # no transformers blocks: the error names what to pass


class _Wrapped(nn.Module):
    """A wrapper as DDP is one: the model under ``.module``, called with its keywords."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


def test_a_plain_model_behind_a_wrapper_is_found_and_called_with_its_forward_s_arguments():
    import torch

    from adacc_hf.adapters import plain
    from adacc_hf.adapters.forward import call_batch, model_inputs
    from adacc_hf.runtime.peak import forward_loss

    model = _Stack()
    wrapped = _Wrapped(model)
    x = torch.randn(2, 4, 8)
    batch = {"x": x, "target": torch.zeros(2)}  # `target`: read by a loss, not by the forward
    plain.register(wrapped, "enc.*")
    try:
        assert plain.plain_model(wrapped) is plain.plain_model(model) is not None
        assert plain.registered(model) is plain.plain_model(model)
        assert plain.registered(wrapped) is None  # the unwrapped model only: no looking through
        assert model_inputs(wrapped, batch) == {"x": x}
        assert call_batch(wrapped, (x,), {}) == {"x": x}
        assert torch.equal(forward_loss(wrapped, batch), model(x))  # the loss it returned
    finally:
        plain.unregister(wrapped)
    assert plain.plain_model(model) is None and model_inputs(wrapped, batch) == batch


def test_the_plain_forward_hook_is_counted_and_restores_the_forward():
    import torch

    from adacc_hf.adapters.forward import hook_forward, unhook_forward

    block = _Mix()
    own = block.forward  # an instance-level forward of the user's own stays theirs
    block.forward = own
    calls = []
    hook_forward(block)
    hook_forward(block)
    block.gradient_checkpointing = True
    block._gradient_checkpointing_func = lambda fn, *args: calls.append(1) or fn(*args)
    x = torch.randn(2, 8)
    block(x)
    with torch.no_grad():
        block(x)  # no gradients: no checkpoint
    assert calls == [1]
    unhook_forward(block)
    assert block.forward.__func__ is not own.__func__  # still hooked once
    unhook_forward(block)
    assert vars(block)["forward"] is own
