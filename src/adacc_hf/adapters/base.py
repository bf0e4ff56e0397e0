"""What an adapter knows about one model family: where its blocks are and what each op is.

An adapter finds the transformer blocks of a model (grouped by structure: blocks in a group run the
same op sequence, so one per-op table serves them all) and gives every submodule of a block a layer
type. The layer type of an aten op inside a block selects its codec family (see `CODEC_FOR_LAYER`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..schema import ATTENTION_CORE, CODEC_FOR_LAYER, LAYER_TYPES

__all__ = [
    "ATTENTION_CORE",
    "CODEC_FOR_LAYER",
    "LAYER_TYPES",
    "Adapter",
    "BlockGroup",
    "classify_attention_ops",
]

# aten packets that start the attention core: the scores matmul (or a fused kernel).
_MATMUL_PACKETS = frozenset({"bmm", "mm", "matmul", "baddbmm"})
_SOFTMAX_PACKETS = frozenset({"_softmax", "softmax", "_safe_softmax"})


def is_fused_attention(packet: str) -> bool:
    return packet.startswith("_scaled_dot_product") or packet.startswith("_flash_attention")


def classify_attention_ops(packets: list[str]) -> list[str]:
    """Layer types for the ops run by an attention module's own code, in execution order.

    Before the first matmul: rotary embedding, KV repeat and masks (`qkv`); from it up to the
    softmax: scores; the softmax output: probs; after it until the next matmul: dropout; that matmul:
    context; after it: head merge (`attn_out`). A fused SDPA op is `attn_fused`.
    """
    types: list[str] = []
    stage = "pre"
    for p in packets:
        if is_fused_attention(p):
            types.append("attn_fused")
            stage = "post"
        elif stage == "pre":
            if p in _MATMUL_PACKETS:
                stage = "scores"
                types.append("attn_scores")
            else:
                types.append("qkv")
        elif stage == "scores":
            if p in _SOFTMAX_PACKETS:
                stage = "probs"
                types.append("attn_probs")
            else:
                types.append("attn_scores")
        elif stage == "probs":
            if p in _MATMUL_PACKETS:
                stage = "post"
                types.append("attn_context")
            else:
                types.append("attn_dropout")
        else:
            types.append("attn_out")
    return types


@dataclass
class BlockGroup:
    """Blocks that share one structure (and therefore one per-op table)."""

    name: str
    paths: list[str]
    modules: list[nn.Module] = field(repr=False)


@dataclass(frozen=True)
class Adapter:
    """Describes one model family.

    `roles` maps a submodule path inside a block (exact, relative to the block) to a layer type;
    unlisted submodules inherit their parent's type, and code that runs in no listed submodule is
    `elementwise`. `attention` lists the attention modules whose own code holds the attention core.
    """

    name: str
    model_types: tuple[str, ...]
    block_classes: tuple[str, ...]
    roles: dict[str, str]
    attention: tuple[str, ...]
    version: int = 1

    def find_blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """All transformer blocks of `model`, in forward order, with their module paths.

        Classes match through their bases too: FSDP2's `fully_shard` swaps a block's class for a
        subclass (`FSDPLlamaDecoderLayer`)."""
        blocks = [
            (name, mod)
            for name, mod in model.named_modules()
            if any(c.__name__ in self.block_classes for c in type(mod).__mro__)
        ]
        return blocks

    def group_key(self, path: str, index: int, module: nn.Module) -> str:
        """The group a block belongs to. Families whose blocks differ override this."""
        return "block"

    def block_groups(self, model: nn.Module) -> list[BlockGroup]:
        groups: dict[str, BlockGroup] = {}
        for i, (path, mod) in enumerate(self.find_blocks(model)):
            key = self.group_key(path, i, mod)
            g = groups.setdefault(key, BlockGroup(key, [], []))
            g.paths.append(path)
            g.modules.append(mod)
        return list(groups.values())

    def roles_for(self, group: str) -> dict[str, str]:
        """The role map of a block group (families whose groups differ override this)."""
        return self.roles

    def region_type(self, region: str, group: str) -> str:
        """Layer type of the code running in submodule `region` ('' is the block's own code)."""
        roles = self.roles_for(group)
        probe = region
        while probe:
            if probe in roles:
                return roles[probe]
            probe = probe.rpartition(".")[0]
        return "elementwise"

    def layer_types(self, ops: list[tuple[str, str]], group: str) -> list[str]:
        """Layer type of each (region, aten packet) op of one block, in execution order."""
        out = [""] * len(ops)
        by_attention: dict[str, list[int]] = {}
        for i, (region, _packet) in enumerate(ops):
            if region in self.attention:
                by_attention.setdefault(region, []).append(i)
            else:
                out[i] = self.region_type(region, group)
        for idx in by_attention.values():
            for i, t in zip(idx, classify_attention_ops([ops[i][1] for i in idx]), strict=True):
                out[i] = t
        return out
