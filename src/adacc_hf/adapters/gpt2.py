"""GPT-2 blocks (Conv1D projections, fused c_attn, tanh-GELU)."""

from __future__ import annotations

from .base import Adapter

GPT2 = Adapter(
    name="gpt2",
    model_types=("gpt2",),
    block_classes=("GPT2Block",),
    roles={
        "ln_1": "norm",
        "ln_2": "norm",
        "attn.c_attn": "qkv",
        "attn.attn_dropout": "attn_dropout",
        "attn.c_proj": "attn_out",
        "attn.resid_dropout": "dropout",
        "mlp.c_fc": "mlp_up",
        "mlp.act": "act",
        "mlp.c_proj": "mlp_down",
        "mlp.dropout": "dropout",
    },
    attention=("attn",),
)
