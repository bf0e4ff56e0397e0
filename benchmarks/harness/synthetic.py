"""Synthetic block profiles for the solver benchmark, shaped like each family's block.

llama ~40 ops, gpt2 ~35, bert ~30, t5 in 4 groups; sized like real models at a real micro-batch
(`FAMILIES`), with op and codec times from a simple roofline and +-3 % seeded noise (real
measurements never tie exactly). No model is built: `synthetic_profile` is pure arithmetic.
"""

from __future__ import annotations

import random

from adacc_hf.schema import CodecProfile, GroupProfile, OpProfile, Profile

FLOPS, BW, CODEC_BW = 200e12, 2e12, 1e12  # matmul FLOP/s, elementwise and codec bytes/s
RATIO = {"int4_outlier": 3.6, "int4_channel": 3.9, "int4_asym": 3.9, "int4_naive": 4.0}
ERROR = {"int4_outlier": 0.06, "int4_channel": 0.09, "int4_asym": 0.08, "int4_naive": 0.2}
CODEC = {  # layer type -> profiled codecs (its own + naive INT4)
    "norm": ("int4_outlier", "int4_naive"),
    "qkv": ("int4_channel", "int4_naive"),
    "attn_scores": ("int4_asym", "int4_naive"),
    "attn_probs": ("int4_asym", "int4_naive"),
    "attn_context": ("int4_channel", "int4_naive"),
    "attn_out": ("int4_outlier", "int4_naive"),
    "mlp_up": ("int4_outlier", "int4_naive"),
    "act": ("int4_outlier", "int4_naive"),
    "mlp_down": ("int4_outlier", "int4_naive"),
    "elementwise": ("int4_outlier", "int4_naive"),
}

# (key, layer type, output size in units of the hidden state ("h"), "4h", "s" = scores, "r" =
#  one value per row), matmul FLOPs per output element (0: elementwise), cacheable)
_NORM = [("pow#0", "h", 0), ("mean#0", "r", 0), ("add#0", "r", 0), ("rsqrt#0", "r", 0)]
_NORM += [("mul#0", "h", 0), ("mul#1", "h", 0)]
_ROPE = [("mul#0", "h", 0), ("neg#0", "h", 0), ("cat#0", "h", 0), ("mul#1", "h", 0)]
_ROPE += [("add#0", "h", 0), ("mul#2", "h", 0), ("neg#1", "h", 0), ("cat#1", "h", 0)]
_ROPE += [("mul#3", "h", 0), ("add#1", "h", 0)]


def _attention_core(
    where: str, matmul: str, mask: str, dropout: str, *, scaled: bool = True
) -> list[tuple]:
    """Scores (matmul, scale, mask), softmax, dropout and context of one attention."""
    ops = [(f"{where}/{matmul}#0", "attn_scores", "s", 2, True)]
    if scaled:
        ops.append((f"{where}/div#0", "attn_scores", "s", 0, True))
    return [
        *ops,
        (f"{where}/{mask}#0", "attn_scores", "s", 0, True),
        (f"{where}/_softmax#0", "attn_probs", "s", 0, True),
        (f"{dropout}/native_dropout#0", "attn_probs", "s", 0, False),
        (f"{where}/{matmul}#1", "attn_context", "h", 2, True),
    ]


def _llama() -> list[tuple]:
    ops = [(f"input_layernorm/{k}", "norm", s, f, True) for k, s, f in _NORM]
    ops += [(f"self_attn.{p}_proj/mm#0", "qkv", "h", 2, True) for p in "qkv"]
    ops += [(f"self_attn/rope/{k}", "qkv", s, f, True) for k, s, f in _ROPE]
    ops += _attention_core("self_attn", "bmm", "add", "self_attn")
    ops += [
        ("self_attn.o_proj/mm#0", "attn_out", "h", 2, True),
        ("/add#0", "elementwise", "h", 0, True),
    ]
    ops += [(f"post_attention_layernorm/{k}", "norm", s, f, True) for k, s, f in _NORM]
    ops += [
        ("mlp.gate_proj/mm#0", "mlp_up", "4h", 2, True),
        ("mlp.up_proj/mm#0", "mlp_up", "4h", 2, True),
        ("mlp.act_fn/silu#0", "act", "4h", 0, True),
        ("mlp/mul#0", "elementwise", "4h", 0, True),
        ("mlp.down_proj/mm#0", "mlp_down", "h", 8, True),
        ("/add#1", "elementwise", "h", 0, True),
    ]
    return ops


def _gpt2() -> list[tuple]:
    ln = [("native_layer_norm#0", "h", 0), ("mean#0", "r", 0), ("rstd#0", "r", 0)]
    ops = [(f"ln_1/{k}", "norm", s, f, True) for k, s, f in ln]
    ops += [
        ("attn.c_attn/addmm#0", "qkv", "3h", 2, True),
        *_attention_core("attn", "matmul", "where", "attn.attn_dropout"),
        ("attn.c_proj/addmm#0", "attn_out", "h", 2, True),
        ("attn.resid_dropout/native_dropout#0", "elementwise", "h", 0, False),
        ("/add#0", "elementwise", "h", 0, True),
    ]
    ops += [(f"ln_2/{k}", "norm", s, f, True) for k, s, f in ln]
    ops += [("mlp.c_fc/addmm#0", "mlp_up", "4h", 2, True)]
    ops += [(f"mlp.act/{k}#0", "act", "4h", 0, True) for k in ("mul", "pow", "mul_1", "add")]
    ops += [(f"mlp.act/{k}#0", "act", "4h", 0, True) for k in ("mul_2", "tanh", "add_1", "mul_3")]
    ops += [
        ("mlp.c_proj/addmm#0", "mlp_down", "h", 8, True),
        ("mlp.dropout/native_dropout#0", "elementwise", "h", 0, False),
        ("/add#1", "elementwise", "h", 0, True),
    ]
    ops += [(f"extra/view#{i}", "elementwise", "h", 0, True) for i in range(4)]
    return ops


def _bert() -> list[tuple]:
    ln = [("native_layer_norm#0", "h", 0), ("mean#0", "r", 0), ("rstd#0", "r", 0)]
    ops = [(f"attention.self.{p}/addmm#0", "qkv", "h", 2, True) for p in ("query", "key", "value")]
    ops += _attention_core("attention.self", "matmul", "add", "attention.self.dropout")
    ops += [
        ("attention.output.dense/addmm#0", "attn_out", "h", 2, True),
        ("attention.output.dropout/native_dropout#0", "elementwise", "h", 0, False),
        ("attention.output/add#0", "elementwise", "h", 0, True),
    ]
    ops += [(f"attention.output.LayerNorm/{k}", "norm", s, f, True) for k, s, f in ln]
    ops += [
        ("intermediate.dense/addmm#0", "mlp_up", "4h", 2, True),
        ("intermediate/gelu#0", "act", "4h", 0, True),
        ("output.dense/addmm#0", "mlp_down", "h", 8, True),
        ("output.dropout/native_dropout#0", "elementwise", "h", 0, False),
        ("output/add#0", "elementwise", "h", 0, True),
    ]
    ops += [(f"output.LayerNorm/{k}", "norm", s, f, True) for k, s, f in ln]
    ops += [(f"extra/view#{i}", "elementwise", "h", 0, True) for i in range(4)]
    return ops


def _t5(decoder: bool, first: bool) -> list[tuple]:
    ops = []
    for li, attn in enumerate(
        ("SelfAttention", "EncDecAttention") if decoder else ("SelfAttention",)
    ):
        pre = f"layer.{li}"
        ops += [(f"{pre}.layer_norm/{k}", "norm", s, f, True) for k, s, f in _NORM[:2]]
        ops += [(f"{pre}.layer_norm/{k}", "norm", s, f, True) for k, s, f in _NORM[3:]]
        ops += [(f"{pre}.{attn}.{p}/mm#0", "qkv", "h", 2, True) for p in "qkv"]
        ops += _attention_core(f"{pre}.{attn}", "matmul", "add", f"{pre}.{attn}", scaled=False)
        ops += [
            (f"{pre}.{attn}.o/mm#0", "attn_out", "h", 2, True),
            (f"{pre}/add#0", "elementwise", "h", 0, True),
        ]
        if first and attn == "SelfAttention":
            ops.append(
                (f"{pre}.{attn}.relative_attention_bias/embedding#0", "attn_scores", "s", 0, True)
            )
    ff = f"layer.{2 if decoder else 1}"
    ops += [(f"{ff}.layer_norm/{k}", "norm", s, f, True) for k, s, f in _NORM[:2]]
    ops += [
        (f"{ff}.DenseReluDense.wi/mm#0", "mlp_up", "4h", 2, True),
        (f"{ff}.DenseReluDense/relu#0", "act", "4h", 0, True),
        (f"{ff}.DenseReluDense.dropout/native_dropout#0", "act", "4h", 0, False),
        (f"{ff}.DenseReluDense.wo/mm#0", "mlp_down", "h", 8, True),
        (f"{ff}/add#0", "elementwise", "h", 0, True),
    ]
    return ops


# family -> (hidden, heads, seq, batch, bytes/element, {group: (blocks, op list)})
FAMILIES = {
    "llama": (2048, 32, 2048, 2, 2, {"layers": (22, _llama())}),
    "gpt2": (768, 12, 1024, 8, 2, {"h": (12, _gpt2())}),
    "bert": (768, 12, 512, 16, 2, {"layer": (12, _bert())}),
    "t5": (
        768,
        12,
        512,
        8,
        2,
        {
            "encoder.first": (1, _t5(False, True)),
            "encoder": (11, _t5(False, False)),
            "decoder.first": (1, _t5(True, True)),
            "decoder": (11, _t5(True, False)),
        },
    ),
}


def synthetic_profile(family: str, seed: int = 0) -> Profile:
    hidden, heads, seq, batch, elt, spec = FAMILIES[family]
    rng = random.Random(seed)
    tokens = seq * batch
    numel = {"h": tokens * hidden, "3h": 3 * tokens * hidden, "4h": 4 * tokens * hidden}
    numel |= {"s": batch * heads * seq * seq, "r": tokens}

    def noisy(x: float) -> float:
        return x * rng.uniform(0.97, 1.03)

    groups = {}
    for name, (blocks, spec_ops) in spec.items():
        ops = []
        last_add = max(i for i, o in enumerate(spec_ops) if "/add#" in o[0])  # the block output
        for i, (key, layer_type, size, flops, cacheable) in enumerate(spec_ops):
            n = numel[size]
            nbytes = n * elt
            ms = 1e3 * (n * flops * hidden / FLOPS if flops else 3 * nbytes / BW)
            op = OpProfile(
                key=key,
                layer_type=layer_type,
                shape=(n // hidden, hidden) if n % hidden == 0 else (n,),
                dtype="torch.bfloat16",
                nbytes=nbytes,
                saved=True,
                cacheable=cacheable,
                fwd_ms=noisy(ms),
                block_output=i == last_add,
                shared_nbytes=nbytes if i == last_add else 0,
            )
            if cacheable and size != "r":
                for codec in CODEC.get(layer_type, ()):
                    enc = noisy(1e3 * 1.5 * nbytes / CODEC_BW)
                    op.codecs[codec] = CodecProfile(
                        codec, {}, int(nbytes / RATIO[codec]), enc, 0.6 * enc, ERROR[codec]
                    )
            ops.append(op)
        x = tokens * hidden * elt
        full = x + sum(o.nbytes for o in ops if o.saved and not o.block_output)
        groups[name] = GroupProfile(
            name=name,
            num_blocks=blocks,
            input_nbytes=x,
            full_nbytes=full,
            fixed_ms=sum(o.fwd_ms for o in ops if not o.cacheable) + 0.02,
            transient_nbytes=full - x + max(o.nbytes for o in ops),
            block_fwd_ms=sum(o.fwd_ms for o in ops),
            ops=ops,
        )
    vocab = 32000 if family == "llama" else 50257
    return Profile(
        model_type=family,
        adapter=family,
        adapter_version=1,
        device="cuda:0",
        dtype="torch.bfloat16",
        batch_shape={"input_ids": [batch, seq]},
        groups=groups,
        nonblock_nbytes=tokens * (hidden + vocab) * elt,
        head_transient_nbytes=tokens * vocab * 4,
    )
