"""The generic adapter: any transformers model whose blocks are `GradientCheckpointingLayer`s.

* Blocks: every outermost `GradientCheckpointingLayer` of the model (transformers >= 4.56 derives
  every decoder / encoder layer from it; it is also the hook the runtime installs through).
* Groups: blocks whose class, submodule tree (names and classes) and attention kind
  (``attention_type`` / ``layer_type`` / ``is_sliding`` / ``sliding_window`` attributes) are equal
  run the same op sequence. Gemma-2/3 sliding and global layers, Qwen2-MoE sparse and
  ``mlp_only_layers`` blocks, BART encoder and decoder layers form separate groups.
* Layer types: from submodule names and classes (`rules.submodule_roles`).
* Mixture-of-experts: fused experts must run a fixed op sequence (transformers' ``grouped_mm``,
  its default, or ``batched_mm``); the eager per-expert loop changes its ops with the routing.
"""

from __future__ import annotations

import re

from torch import nn

from ..errors import UnsupportedModelError
from .base import Adapter
from .rules import Roles, class_name, submodule_roles

#: Model types the test suite runs end to end (tests/adapters/test_families.py); docs/families.md lists them.
VERIFIED_MODEL_TYPES = (
    "bart", "bert", "bloom", "cohere", "deberta-v2", "distilbert", "falcon", "gemma", "gemma2",
    "gemma3_text", "glm", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "granite", "helium", "llama",
    "mistral", "mixtral", "modernbert", "olmo", "olmo2", "opt", "phi", "phi3", "qwen2",
    "qwen2_moe", "qwen3", "qwen3_moe", "roberta", "smollm3", "stablelm", "starcoder2", "t5",
)  # fmt: skip

# Per-layer attributes that change a block's op sequence without changing its submodules.
_KIND_ATTRS = ("attention_type", "layer_type", "is_sliding", "sliding_window")


def gradient_checkpointing_layer() -> type | None:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers < 4.52
        return None
    return GradientCheckpointingLayer


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _kind(block: nn.Module) -> tuple:
    found = []
    for path, m in block.named_modules():
        for attr in _KIND_ATTRS:
            value = vars(m).get(attr, ...)
            if value is None or isinstance(value, (str, bool, int)):
                found.append((path, attr, value))
    return tuple(found)


def _kind_label(kind: tuple) -> str:
    for want in ("attention_type", "layer_type"):
        for _, attr, value in kind:
            if attr == want and isinstance(value, str):
                return value
    for _, attr, value in kind:
        if attr == "is_sliding":
            return "sliding" if value else "full"
    windows = [v for _, a, v in kind if a == "sliding_window"]
    return f"window_{windows[0]}" if windows and windows[0] is not None else "full"


def _class_label(name: str) -> str:
    for word in ("Encoder", "Decoder"):
        if word in name:
            return word.lower()
    return _snake(name)


class GenericAdapter(Adapter):
    """Blocks, groups and layer types read off the model (see the module docstring)."""

    name = "generic"
    version = 2

    def find_blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Outermost `GradientCheckpointingLayer`s, in module order. Classes match through their
        bases: FSDP2's `fully_shard` swaps a block's class for a subclass."""
        gcl = gradient_checkpointing_layer()
        if gcl is None:
            return []
        blocks: list[tuple[str, nn.Module]] = []
        for path, mod in model.named_modules():
            if isinstance(mod, gcl) and not any(path.startswith(p + ".") for p, _ in blocks):
                blocks.append((path, mod))
        return blocks

    def signature(self, path: str, block: nn.Module) -> tuple:
        tree = tuple((p, class_name(m)) for p, m in block.named_modules() if p)
        return (class_name(block), _kind(block), tree)

    def group_names(self, signatures: list[tuple], blocks: list[nn.Module]) -> list[str]:
        if len(signatures) == 1:
            return ["block"]
        classes = {s[0] for s in signatures}
        names = []
        for sig, block in zip(signatures, blocks, strict=True):
            same_class = [s for s in signatures if s[0] == sig[0]]
            parts = [_class_label(sig[0])] if len(classes) > 1 else []
            if len({s[1] for s in same_class}) > 1:
                parts.append(_kind_label(sig[1]))
            same_kind = [s for s in same_class if s[1] == sig[1]]
            if len(same_kind) > 1:
                roles = self.roles(block)
                parts.append("moe" if roles.experts or roles.routers else "dense")
            names.append("_".join(parts) or "block")
        for i, n in enumerate(names):  # still ambiguous: number them
            if names.count(n) > 1:
                names[i] = f"{n}_{names[:i].count(n)}"
        return names

    def roles(self, block: nn.Module) -> Roles:
        return submodule_roles(block)

    def check(self, model: nn.Module) -> None:
        blocks = self.find_blocks(model)
        if not blocks:
            raise UnsupportedModelError(
                f"{type(model).__name__} has no transformers GradientCheckpointingLayer blocks: "
                "adacc-hf patches models whose transformer blocks derive from "
                "transformers.modeling_layers.GradientCheckpointingLayer (every decoder and encoder "
                "layer of transformers >= 5; verified end to end on "
                f"{', '.join(VERIFIED_MODEL_TYPES)}). Upgrade transformers, derive your block "
                "class from GradientCheckpointingLayer, or name the blocks: "
                "adacc_hf.prepare(model, budget, batch, blocks='layers.*') (docs/families.md)."
            )
        seen: set[type] = set()
        for path, block in blocks:
            if type(block) in seen:
                continue
            seen.add(type(block))
            for sub in self.roles(block).experts:
                impl = getattr(
                    getattr(block.get_submodule(sub), "config", None),
                    "_experts_implementation",
                    None,
                )
                if impl == "eager":
                    raise UnsupportedModelError(
                        f"the experts of {path}.{sub} run experts_implementation={impl!r}: its "
                        "ops change with the routing from batch to batch, which per-op policies "
                        "cannot address. Call model.set_experts_implementation('grouped_mm') "
                        "(transformers' default; 'batched_mm' also works) or load the model with "
                        "experts_implementation='grouped_mm'."
                    )
