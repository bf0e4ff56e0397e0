"""Tiny random-init models of every transformers family adacc-hf is tested on (offline).

``family_model("gemma2")`` builds a 2-layer, hidden-64 model of that `config.model_type` with
dropout on (so checkpointing's RNG replay is exercised) and ``use_cache=False``;
``family_batch(model)`` a deterministic training batch for it. `FAMILIES` says, per model type,
what kind of head it trains (causal LM, masked LM, seq2seq) and the config overrides its tiny
version needs. Nothing is downloaded: configs come from the installed transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["FAMILIES", "Family", "family_batch", "family_config", "family_model"]

Kind = Literal["causal", "masked", "seq2seq"]

#: Every config gets these (keys a config does not know are ignored by its model).
COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "use_cache": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
DROPOUT = 0.1
#: The dropout knobs of the families below, all set to `DROPOUT`.
DROPOUT_KEYS = (
    "attention_dropout", "attention_probs_dropout_prob", "hidden_dropout_prob", "hidden_dropout",
    "resid_pdrop", "attn_pdrop", "embd_pdrop", "dropout", "residual_dropout", "embedding_dropout",
    "mlp_dropout", "activation_dropout",
)  # fmt: skip
# Small MoE: 4 experts, 2 per token.
MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "output_router_logits": False,
}


@dataclass(frozen=True)
class Family:
    kind: Kind = "causal"
    overrides: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(),
    # Layer 1 is dense (`mlp_only_layers`): the blocks form two groups.
    "qwen2_moe": Family(
        overrides={**MOE, "shared_expert_intermediate_size": 64, "mlp_only_layers": [1]}
    ),
    "qwen3_moe": Family(overrides={**MOE, "norm_topk_prob": True}),
    "mixtral": Family(overrides=MOE),
    "gemma": Family(),
    # Sliding-window layers alternate with global ones (two groups); the window is shorter than
    # the test sequences so the two really differ.
    "gemma2": Family(overrides={"sliding_window": 8, "query_pre_attn_scalar": 16}),
    "gemma3_text": Family(
        overrides={"sliding_window": 8, "query_pre_attn_scalar": 16, "sliding_window_pattern": 2}
    ),
    "phi": Family(),
    "phi3": Family(),
    "gpt_neox": Family(overrides={"rotary_pct": 0.5}),
    "opt": Family(overrides={"ffn_dim": 128, "word_embed_proj_dim": 64}),
    "olmo": Family(),
    "olmo2": Family(),
    "granite": Family(),
    "cohere": Family(),
    "stablelm": Family(),
    "starcoder2": Family(),
    "gpt_bigcode": Family(overrides={"n_inner": 128}),
    "bloom": Family(overrides={"n_head": 4}),
    "gptj": Family(overrides={"rotary_dim": 8, "n_inner": 128}),
    "smollm3": Family(),
    "glm": Family(),
    "helium": Family(),
    "falcon": Family(overrides={"num_kv_heads": 4}),
    "gpt2": Family(overrides={"n_inner": 128}),
    "bert": Family(kind="masked"),
    "roberta": Family(kind="masked"),
    "distilbert": Family(
        kind="masked", overrides={"hidden_dim": 128, "sinusoidal_pos_embds": False}
    ),
    "deberta-v2": Family(kind="masked"),
    "modernbert": Family(
        kind="masked",
        overrides={"global_attn_every_n_layers": 2, "local_attention": 8, "mask_token_id": 3},
    ),
    "bart": Family(
        kind="seq2seq",
        overrides={
            "decoder_layers": 2,
            "decoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "decoder_ffn_dim": 128,
            "decoder_start_token_id": 2,
            "forced_eos_token_id": None,
        },
    ),
    "t5": Family(
        kind="seq2seq",
        overrides={
            "d_kv": 16,
            "d_ff": 128,
            "num_decoder_layers": 2,
            "decoder_start_token_id": 0,
            "relative_attention_num_buckets": 8,
        },
    ),
}

_AUTO = {
    "causal": "AutoModelForCausalLM",
    "masked": "AutoModelForMaskedLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
}
MASK_ID = 3  # masked-LM batches: 0 pad, 1 bos / cls, 2 eos / sep, 3 mask
_FIRST_PLAIN_ID = 4


def _family(model_type: str) -> Family:
    fam = FAMILIES.get(model_type)
    if fam is None:
        raise ValueError(f"no tiny config for {model_type!r}; known: {', '.join(sorted(FAMILIES))}")
    return fam


def family_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """The tiny config of `model_type` (see the module docstring); `overrides` go on top."""
    fam = _family(model_type)
    kwargs = {**COMMON, **dict.fromkeys(DROPOUT_KEYS, DROPOUT), **fam.overrides, **overrides}
    cls = transformers.CONFIG_MAPPING[model_type]
    # Some configs derive a common key (Falcon's head_dim): leave those to the config.
    derived = {k for k in kwargs if isinstance(getattr(cls, k, None), property)}
    derived = {k for k in derived if getattr(cls, k).fset is None}
    return cls(**{k: v for k, v in kwargs.items() if k not in derived})


def family_model(model_type: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny random-init model of `model_type` (seeded, fp32, train mode)."""
    config = family_config(model_type, **overrides)
    auto = getattr(transformers, _AUTO[_family(model_type).kind])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32)
    return model.train()


def family_batch(
    model: PreTrainedModel, batch_size: int = 2, seq_len: int = 16, seed: int = 0
) -> dict[str, torch.Tensor]:
    """A deterministic training batch for a tiny model made by `family_model`.

    Causal LMs: all-ones mask, ``labels = input_ids``. Masked LMs: last row right-padded, ~15 %
    of tokens masked (at least one per row), labels ``-100`` elsewhere. Seq2seq: last row
    right-padded, labels of length ``seq_len // 2``.
    """
    config = model.config
    kind = _family(config.model_type).kind
    gen = torch.Generator().manual_seed(seed)

    def rand_ids(*shape: int) -> torch.Tensor:
        return torch.randint(_FIRST_PLAIN_ID, config.vocab_size, shape, generator=gen)

    ids = rand_ids(batch_size, seq_len)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if kind == "causal":
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
    else:
        n_pad = seq_len // 4
        ids[-1, -n_pad:] = 0
        mask[-1, -n_pad:] = 0
        if kind == "seq2seq":
            batch = {
                "input_ids": ids,
                "attention_mask": mask,
                "labels": rand_ids(batch_size, seq_len // 2),
            }
        else:
            masked = (torch.rand(batch_size, seq_len, generator=gen) < 0.15) & mask.bool()
            masked[:, 1] = True
            labels = torch.where(masked, ids, torch.full_like(ids, -100))
            ids = torch.where(masked, torch.full_like(ids, MASK_ID), ids)
            batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return {k: v.to(model.device) for k, v in batch.items()}
