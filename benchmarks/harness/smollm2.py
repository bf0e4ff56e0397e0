"""The real SmolLM2-135M as the SmolLM2 benchmarks train it: its states present, on real text."""

from __future__ import annotations

import torch

from adacc_hf import assets

from .steps import optimizer_with_states


def text_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    """The first `n_tokens` tokens of the Shakespeare text."""
    text = assets.shakespeare_text(max_chars=n_tokens * 6)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    assert ids.numel() >= n_tokens, "not enough text"
    return ids[:n_tokens]


def lm_batch(ids: torch.Tensor, rows: int, seq: int) -> dict[str, torch.Tensor]:
    """`rows` x `seq` tokens of `ids` (a storage of its own) as a causal-LM batch."""
    x = ids[: rows * seq].view(rows, seq).clone()
    return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}


def model_and_optimizer(attn_implementation: str | None = None):
    """SmolLM2 in train mode and an AdamW whose states exist (as in a running fine-tune), no step
    taken on the weights (learning rate 0)."""
    model, _ = assets.load_smollm2(attn_implementation=attn_implementation)
    model.train()
    return model, optimizer_with_states(model)
