"""Layer types read off a block's submodules: their names, classes and where they sit.

`submodule_roles(block)` gives every submodule of a transformer block a layer type (or None for a
container whose own code is glue), and names the modules whose own code holds the attention core
and the fused mixture-of-experts modules. The rules cover the naming conventions of the
transformers families (LLaMA-likes, GPT-2 / GPT-J / GPT-NeoX / Falcon / Bloom, BERT-likes, T5,
BART, ModernBERT, MoE routers and experts) and of plain PyTorch models (nanoGPT, torchtitan's
``wq`` / ``wk`` / ``wv`` / ``wo``, timm's ``qkv`` / ``proj``); anything unrecognised is left to its parent, and code
in no recognised module is `elementwise` (its codec is the outlier-robust one).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# Projections by their last name component (lower case).
QKV_NAMES = frozenset(
    {
        "q_proj", "k_proj", "v_proj", "qkv_proj", "kv_proj", "query", "key", "value",
        "query_key_value", "c_attn", "q_attn", "wqkv", "q_lin", "k_lin", "v_lin", "query_proj",
        "key_proj", "value_proj", "q", "k", "v", "in_proj", "qkv", "q_a_proj", "q_b_proj",
        "kv_a_proj_with_mqa", "kv_b_proj", "wq", "wk", "wv",
    }
)  # fmt: skip
ATTN_OUT_NAMES = frozenset({"o_proj", "out_proj", "dense", "c_proj", "o", "wo", "out_lin", "proj"})
MLP_UP_NAMES = frozenset(
    {
        "gate_proj", "up_proj", "gate_up_proj", "fc1", "w1", "w3", "c_fc", "dense_h_to_4h",
        "fc_in", "lin1", "wi", "wi_0", "wi_1",
    }
)  # fmt: skip
MLP_DOWN_NAMES = frozenset(
    {"down_proj", "fc2", "w2", "c_proj", "dense_4h_to_h", "fc_out", "lin2", "wo"}
)
ACT_NAMES = frozenset(
    {"act", "act_fn", "activation_fn", "activation", "gelu_impl", "intermediate_act_fn"}
)
QK_NORM_NAMES = frozenset({"q_norm", "k_norm", "q_layernorm", "k_layernorm"})
NORM_NAMES = frozenset({"ln_1", "ln_2", "ln_f"})
ROUTER_NAMES = frozenset({"gate", "router"})
# BERT-style feed-forward: `intermediate.dense` goes up, `output.dense` comes down.
_UP_PARENTS = frozenset({"intermediate"})
_DOWN_PARENTS = frozenset({"output"})
_RESIDUAL_DROPOUT_HINTS = ("resid", "out", "proj", "hidden")


@dataclass
class Roles:
    """What the rules found in one block (paths relative to the block)."""

    types: dict[str, str]  # submodule -> layer type (containers whose code is glue are absent)
    attention: tuple[str, ...]  # modules whose own code runs the attention core
    experts: tuple[str, ...]  # fused experts (3-D weights): their matmuls alternate up / down
    routers: tuple[str, ...]


def class_name(module: nn.Module) -> str:
    """The class name, without the prefix FSDP2's `fully_shard` gives the class it swaps in."""
    name = type(module).__name__
    return name[4:] if name.startswith("FSDP") and len(name) > 4 else name


def _is_attention(module: nn.Module) -> bool:
    return "Attention" in class_name(module)


def _is_norm(name: str, module: nn.Module) -> bool:
    return "Norm" in class_name(module) or "norm" in name or name in NORM_NAMES


def _is_activation(name: str, module: nn.Module) -> bool:
    mod = type(module).__module__
    torch_act = mod == "torch.nn.modules.activation" and not isinstance(
        module, (nn.Softmax, nn.MultiheadAttention)
    )
    return mod.startswith("transformers.activations") or torch_act or name in ACT_NAMES


def _is_experts(name: str, module: nn.Module) -> bool:
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return False  # one submodule per expert: each is an ordinary MLP, keyed by its own path
    return "Experts" in class_name(module) or name == "experts"


def _is_router(name: str, module: nn.Module, parent: nn.Module | None) -> bool:
    if "Router" in class_name(module):
        return True
    return name in ROUTER_NAMES and parent is not None and hasattr(parent, "experts")


def _leaf_type(
    path: str, module: nn.Module, parent: nn.Module | None, in_attention: bool, innermost: bool
) -> str | None:
    """The layer type of one submodule by its name and class; None: inherit from the parent."""
    parts = path.split(".")
    name = parts[-1].lower()
    parent_name = parts[-2].lower() if len(parts) > 1 else ""
    if isinstance(module, nn.Dropout) or "Dropout" in class_name(module):
        stem = name.replace("dropout", "").replace("drop", "")
        inner = innermost and not any(h in stem for h in _RESIDUAL_DROPOUT_HINTS)
        return "attn_dropout" if inner else "dropout"
    if in_attention and name in QK_NORM_NAMES:
        return "qkv"
    if _is_norm(name, module):
        return "norm"
    if _is_activation(name, module):
        return "act"
    if in_attention:
        if isinstance(module, nn.Softmax):
            return "attn_probs"
        if isinstance(module, nn.Embedding):
            return "attn_scores"  # relative position bias (T5)
        if name in QKV_NAMES or "rotary" in name:
            return "qkv"
        if name in ATTN_OUT_NAMES:
            return "attn_out"
        return None
    if name in MLP_UP_NAMES or (name == "dense" and parent_name in _UP_PARENTS):
        return "mlp_up"
    if name in MLP_DOWN_NAMES or (name == "dense" and parent_name in _DOWN_PARENTS):
        return "mlp_down"
    return None


def submodule_roles(block: nn.Module) -> Roles:
    """Layer types of every submodule of `block`, its attention modules and MoE experts."""
    modules = dict(block.named_modules())
    attention = {p for p, m in modules.items() if p and _is_attention(m)}
    # The attention core runs in the innermost attention modules (BertSelfAttention inside
    # BertAttention, T5Attention inside T5LayerSelfAttention).
    innermost = {p for p in attention if not any(q.startswith(p + ".") for q in attention)}
    types: dict[str, str] = {}
    experts, routers = [], []
    for path, module in modules.items():
        if not path:
            continue
        parent = modules.get(path.rpartition(".")[0]) if "." in path else block
        name = path.rpartition(".")[2].lower()
        if _is_router(name, module, parent):
            types[path] = "router"
            routers.append(path)
            continue
        if _is_experts(name, module):
            experts.append(path)
            continue
        if any(path.startswith(r + ".") for r in routers):
            continue  # inherits `router`
        scope = [a for a in attention if path == a or path.startswith(a + ".")]
        in_attention = bool(scope)
        owner = max(scope, key=len) if scope else ""
        t = _leaf_type(path, module, parent, in_attention, owner in innermost)
        if t is not None and path not in attention:
            types[path] = t
    return Roles(types, tuple(sorted(innermost)), tuple(experts), tuple(routers))
