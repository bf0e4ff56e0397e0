"""What an adapter knows about a model: where its blocks are and what each op inside a block is.

An adapter finds the transformer blocks of a model, groups them by structure (blocks in a group
run the same op sequence, so one per-op table serves them all) and gives every submodule of a
block a layer type. The layer type of an aten op inside a block selects its codec family (see
`CODEC_FOR_LAYER`). `Adapter` holds the mechanics shared by every adapter (role map -> per-op
layer types); `generic.GenericAdapter` reads blocks, groups and roles off any transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..schema import ATTENTION_CORE, CODEC_FOR_LAYER, LAYER_TYPES
from .rules import Roles

__all__ = [
    "ATTENTION_CORE",
    "CODEC_FOR_LAYER",
    "LAYER_TYPES",
    "Adapter",
    "BlockGroup",
    "classify_attention_ops",
    "classify_experts_ops",
    "unwrap_model",
]

# aten packets that start the attention core: the scores matmul (or a fused kernel).
_MATMUL_PACKETS = frozenset({"bmm", "mm", "matmul", "baddbmm"})
_SOFTMAX_PACKETS = frozenset({"_softmax", "softmax", "_safe_softmax"})
# Matmuls of a fused experts module (eager loop: mm per expert; batched_mm: bmm; grouped_mm).
_EXPERT_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "grouped_mm"})


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


def classify_experts_ops(packets: list[str]) -> list[str]:
    """Layer types for the ops run by a fused experts module's own code, in execution order.

    Its matmuls alternate up (gate / up projection) and down; everything else (token sorting and
    gathering, gating products, weighting by the router) is `elementwise`.
    """
    types, n = [], 0
    for p in packets:
        if p in _EXPERT_MATMULS:
            types.append("mlp_up" if n % 2 == 0 else "mlp_down")
            n += 1
        else:
            types.append("elementwise")
    return types


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside PEFT, DDP, DeepSpeed, FSDP1 and `torch.compile` wrappers.

    Unwraps ``get_base_model()``, ``.module`` and ``._orig_mod``, repeatedly.

    Args:
        model: a model, wrapped or not.

    Returns:
        The innermost model (`model` itself when it wraps nothing).
    """
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
    return model


@dataclass
class BlockGroup:
    """Blocks that share one structure (and therefore one per-op table)."""

    name: str
    paths: list[str]
    modules: list[nn.Module] = field(repr=False)
    roles: Roles = field(default_factory=lambda: Roles({}, (), (), ()), repr=False)


class Adapter:
    """Finds a model's blocks, groups them, and names the layer type of every op in a block.

    Subclasses implement `find_blocks`, `signature`, `group_names` and `roles`. `layer_types`
    turns a group's role map into per-op types: ops in a submodule take its type (or its nearest
    typed ancestor's; ``elementwise`` when none), ops in an attention module's own code are typed
    by position (`classify_attention_ops`), those of fused MoE experts by their matmuls.
    """

    name = "adapter"
    version = 2

    def find_blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """All transformer blocks of `model`, in forward order, with their module paths."""
        raise NotImplementedError

    def signature(self, path: str, block: nn.Module) -> tuple:
        """Blocks with equal signatures run the same op sequence and form one group."""
        raise NotImplementedError

    def group_names(self, signatures: list[tuple], blocks: list[nn.Module]) -> list[str]:
        """One name per distinct signature (in order of first appearance)."""
        raise NotImplementedError

    def roles(self, block: nn.Module) -> Roles:
        raise NotImplementedError

    def check(self, model: nn.Module) -> None:
        """Raise `UnsupportedModelError` (saying what to change) if the model cannot run."""

    def model_type(self, model: nn.Module) -> str:
        """The model's family as policies and profiles record it (``config.model_type``)."""
        return str(unwrap_model(model).config.model_type)

    def block_groups(self, model: nn.Module) -> list[BlockGroup]:
        blocks = self.find_blocks(model)
        sigs = [self.signature(p, m) for p, m in blocks]
        distinct = list(dict.fromkeys(sigs))
        firsts = [blocks[sigs.index(s)][1] for s in distinct]
        names = dict(zip(distinct, self.group_names(distinct, firsts), strict=True))
        groups: dict[str, BlockGroup] = {}
        for (path, mod), sig in zip(blocks, sigs, strict=True):
            g = groups.get(names[sig])
            if g is None:
                g = groups[names[sig]] = BlockGroup(names[sig], [], [], self.roles(mod))
            g.paths.append(path)
            g.modules.append(mod)
        return list(groups.values())

    def region_type(self, region: str, group: BlockGroup) -> str:
        """Layer type of the code running in submodule `region` ('' is the block's own code)."""
        types = group.roles.types
        probe = region
        while probe:
            if probe in types:
                return types[probe]
            probe = probe.rpartition(".")[0]
        return "elementwise"

    def layer_types(self, ops: list[tuple[str, str]], group: BlockGroup) -> list[str]:
        """Layer type of each (region, aten packet) op of one block, in execution order."""
        out = [""] * len(ops)
        special: dict[str, list[int]] = {}
        kinds = dict.fromkeys(group.roles.attention, "attention")
        kinds.update(dict.fromkeys(group.roles.experts, "experts"))
        for i, (region, _packet) in enumerate(ops):
            if region in kinds:
                special.setdefault(region, []).append(i)
            else:
                out[i] = self.region_type(region, group)
        for region, idx in special.items():
            classify = (
                classify_attention_ops if kinds[region] == "attention" else classify_experts_ops
            )
            for i, t in zip(idx, classify([ops[i][1] for i in idx]), strict=True):
                out[i] = t
        return out
