"""T5 encoder blocks and decoder blocks (with cross-attention).

The first block of each stack owns the relative position bias and runs extra ops, and decoder
blocks have a cross-attention layer, so T5 blocks form four groups, each with its own op table.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .base import Adapter

_ROLES = {
    "layer.0.layer_norm": "norm",
    "layer.0.SelfAttention.q": "qkv",
    "layer.0.SelfAttention.k": "qkv",
    "layer.0.SelfAttention.v": "qkv",
    "layer.0.SelfAttention.relative_attention_bias": "attn_scores",
    "layer.0.SelfAttention.o": "attn_out",
    "layer.0.dropout": "dropout",
}
# Encoder: layer.1 is the feed-forward; decoder: layer.1 is cross-attention, layer.2 feed-forward.
_FF = {
    "layer_norm": "norm",
    "DenseReluDense.wi": "mlp_up",
    "DenseReluDense.wi_0": "mlp_up",
    "DenseReluDense.wi_1": "mlp_up",
    "DenseReluDense.act": "act",
    "DenseReluDense.dropout": "dropout",
    "DenseReluDense.wo": "mlp_down",
    "dropout": "dropout",
}
_CROSS = {
    "layer_norm": "norm",
    "EncDecAttention.q": "qkv",
    "EncDecAttention.k": "qkv",
    "EncDecAttention.v": "qkv",
    "EncDecAttention.o": "attn_out",
    "dropout": "dropout",
}
_ROLES.update({f"layer.1.{k}": v for k, v in _FF.items()})
_DECODER_ROLES = {k: v for k, v in _ROLES.items() if not k.startswith("layer.1.")}
_DECODER_ROLES.update({f"layer.1.{k}": v for k, v in _CROSS.items()})
_DECODER_ROLES.update({f"layer.2.{k}": v for k, v in _FF.items()})


@dataclass(frozen=True)
class T5Adapter(Adapter):
    decoder_roles: dict[str, str] | None = None

    def group_key(self, path: str, index: int, module: nn.Module) -> str:
        stack = "decoder" if getattr(module, "is_decoder", False) else "encoder"
        first = module.layer[0].SelfAttention.has_relative_attention_bias
        return f"{stack}_first" if first else stack

    def roles_for(self, group: str) -> dict[str, str]:
        if group.startswith("decoder") and self.decoder_roles is not None:
            return self.decoder_roles
        return self.roles


T5 = T5Adapter(
    name="t5",
    model_types=("t5",),
    block_classes=("T5Block",),
    roles=_ROLES,
    attention=("layer.0.SelfAttention", "layer.1.EncDecAttention"),
    decoder_roles=_DECODER_ROLES,
)
