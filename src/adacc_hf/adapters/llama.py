"""LLaMA and decoder layers with the same structure (Mistral, Qwen2, Qwen3)."""

from __future__ import annotations

from .base import Adapter

LLAMA = Adapter(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3"),
    block_classes=(
        "LlamaDecoderLayer",
        "MistralDecoderLayer",
        "Qwen2DecoderLayer",
        "Qwen3DecoderLayer",
    ),
    roles={
        "input_layernorm": "norm",
        "post_attention_layernorm": "norm",
        "self_attn.q_proj": "qkv",
        "self_attn.k_proj": "qkv",
        "self_attn.v_proj": "qkv",
        "self_attn.q_norm": "qkv",
        "self_attn.k_norm": "qkv",
        "self_attn.o_proj": "attn_out",
        "mlp.gate_proj": "mlp_up",
        "mlp.up_proj": "mlp_up",
        "mlp.act_fn": "act",
        "mlp.down_proj": "mlp_down",
    },
    attention=("self_attn",),
)
