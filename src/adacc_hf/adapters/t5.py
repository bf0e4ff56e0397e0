"""T5: the generic rules type every op right; only the group names are T5's own.

The first block of each stack owns the relative position bias and runs extra ops, and decoder
blocks have a cross-attention layer, so T5 blocks form four groups. They keep the names policies
saved before the generic adapter use: ``encoder_first``, ``encoder``, ``decoder_first``,
``decoder``.
"""

from __future__ import annotations

from torch import nn

from .generic import GenericAdapter


class T5Adapter(GenericAdapter):
    name = "t5"

    def group_names(self, signatures: list[tuple], blocks: list[nn.Module]) -> list[str]:
        names = []
        for block in blocks:
            stack = "decoder" if getattr(block, "is_decoder", False) else "encoder"
            first = block.layer[0].SelfAttention.has_relative_attention_bias
            names.append(f"{stack}_first" if first else stack)
        return names


T5 = T5Adapter()
