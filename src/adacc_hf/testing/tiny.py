"""Tiny random-init models of the supported families (llama, gpt2, t5, bert) with dropout enabled,
and deterministic training batches for them: for fast tests and examples."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["SUPPORTED_FAMILIES", "tiny_batch", "tiny_config", "tiny_model"]


SUPPORTED_FAMILIES = ("llama", "gpt2", "t5", "bert")

_TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        {
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,  # GQA
            "max_position_embeddings": 128,
            "attention_dropout": 0.1,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    "gpt2": (
        "GPT2Config",
        {
            "vocab_size": 256,
            "n_embd": 64,
            "n_inner": 128,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 128,
            "resid_pdrop": 0.1,
            "embd_pdrop": 0.1,
            "attn_pdrop": 0.1,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
    ),
    "t5": (
        "T5Config",
        {
            "vocab_size": 256,
            "d_model": 64,
            "d_kv": 8,
            "d_ff": 128,
            "num_layers": 2,
            "num_decoder_layers": 2,
            "num_heads": 4,
            "relative_attention_num_buckets": 8,
            "dropout_rate": 0.1,
            "pad_token_id": 0,
            "eos_token_id": 1,
            "decoder_start_token_id": 0,
        },
    ),
    "bert": (
        "BertConfig",
        {
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 128,
            "hidden_dropout_prob": 0.1,
            "attention_probs_dropout_prob": 0.1,
            "pad_token_id": 0,
        },
    ),
}

_TINY_MODELS = {
    "llama": "LlamaForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "t5": "T5ForConditionalGeneration",
    "bert": "BertForMaskedLM",
}

_BERT_MASK_ID = 3  # tiny BERT vocab convention: 0 pad, 1 cls, 2 sep, 3 mask
_FIRST_PLAIN_ID = 4  # random tokens avoid the special ids above


def _check_family(family: str) -> str:
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"unknown model family {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return family


def tiny_config(family: str, **overrides: Any) -> PretrainedConfig:
    """Tiny config (2 layers, 4 heads, vocab 256, dropout 0.1, ``use_cache=False``) of a family."""
    cls_name, defaults = _TINY_CONFIGS[_check_family(family)]
    kwargs = {**defaults, "use_cache": False, **overrides}
    return getattr(transformers, cls_name)(**kwargs)


def tiny_model(family: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """Tiny random-init model of ``family`` (seeded, train mode); overrides go to the config."""
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, _TINY_MODELS[family])(config)
    return model.train()


def tiny_batch(
    family: str,
    model_or_config: PreTrainedModel | PretrainedConfig,
    batch_size: int = 2,
    seq_len: int = 16,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Deterministic training batch (with labels) for a tiny model of ``family``.

    Causal LMs: all-ones mask, ``labels = input_ids``. T5: last row right-padded, labels of
    length ``seq_len // 2``. BERT: last row right-padded, ~15% of tokens masked (at least one
    per row), labels ``-100`` elsewhere. Tensors are on the model's device when given a model.
    """
    _check_family(family)
    if isinstance(model_or_config, PreTrainedModel):
        config, device = model_or_config.config, model_or_config.device
    else:
        config, device = model_or_config, torch.device("cpu")
    if config.model_type != family:
        raise ValueError(
            f"family {family!r} does not match config.model_type {config.model_type!r}"
        )
    if seq_len < 4 or batch_size < 1:
        raise ValueError(f"need seq_len >= 4 and batch_size >= 1; got {seq_len=}, {batch_size=}")

    gen = torch.Generator().manual_seed(seed)
    vocab = config.vocab_size

    def rand_ids(*shape: int) -> torch.Tensor:
        return torch.randint(_FIRST_PLAIN_ID, vocab, shape, generator=gen)

    input_ids = rand_ids(batch_size, seq_len)
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    batch: dict[str, torch.Tensor]
    if family in ("llama", "gpt2"):
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": input_ids.clone(),
        }
    else:
        n_pad = seq_len // 4
        pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        input_ids[-1, -n_pad:] = pad_id
        attention_mask[-1, -n_pad:] = 0
        if family == "t5":
            batch = {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "labels": rand_ids(batch_size, seq_len // 2),
            }
        else:  # bert: masked-LM
            masked = (torch.rand(batch_size, seq_len, generator=gen) < 0.15) & attention_mask.bool()
            masked[:, 1] = True  # every row contributes to the loss
            labels = torch.where(masked, input_ids, torch.full_like(input_ids, -100))
            input_ids = torch.where(masked, torch.full_like(input_ids, _BERT_MASK_ID), input_ids)
            batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    return {k: v.to(device) for k, v in batch.items()}
