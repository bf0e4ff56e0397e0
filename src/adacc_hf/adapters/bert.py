"""BERT encoder layers (post-norm)."""

from __future__ import annotations

from .base import Adapter

BERT = Adapter(
    name="bert",
    model_types=("bert",),
    block_classes=("BertLayer",),
    roles={
        "attention.self.query": "qkv",
        "attention.self.key": "qkv",
        "attention.self.value": "qkv",
        "attention.self.dropout": "attn_dropout",
        "attention.output.dense": "attn_out",
        "attention.output.dropout": "dropout",
        "attention.output.LayerNorm": "norm",
        "intermediate.dense": "mlp_up",
        "intermediate.intermediate_act_fn": "act",
        "output.dense": "mlp_down",
        "output.dropout": "dropout",
        "output.LayerNorm": "norm",
    },
    attention=("attention.self",),
)
