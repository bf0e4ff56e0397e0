"""The accuracy suites' tasks: a model factory and train / held-out blocks of Shakespeare.

* ``smollm2``: the real SmolLM2-135M (offline GGUF) fine-tuned on token blocks of the plays;
* ``scratch``: a tiny GPT-2 trained from scratch on the plays' bytes (vocabulary 256).

Blocks are non-overlapping, shuffled with the seed; held-out blocks are never trained on. Every run
of a suite starts from the same weights (`Task.make`) and sees the same blocks in the same order.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers


@dataclass
class Task:
    what: str
    make: Callable[[], torch.nn.Module]  # a fresh model, the same weights each call
    train: torch.Tensor  # [blocks, seq] token ids
    held_out: torch.Tensor


def text_blocks(tokenizer, seq_len: int, n_blocks: int, seed: int) -> list[list[int]]:
    """`n_blocks` non-overlapping `seq_len`-token blocks from the start of the plays, shuffled.

    (Like `adacc_hf.assets.shakespeare_splits`, without its `datasets` dependency, which the GPU
    machine lacks.)"""
    from adacc_hf.assets import shakespeare_text

    text = shakespeare_text()
    need, chars = n_blocks * seq_len, n_blocks * seq_len * 5
    while True:
        cut = text.find("\n\n", chars)
        prefix = text if cut < 0 else text[:cut]
        ids = list(tokenizer(prefix, add_special_tokens=False, verbose=False)["input_ids"])
        if len(ids) >= need + 16 or cut < 0:
            break
        chars *= 2
    if len(ids) < need:
        raise ValueError(f"the plays hold {len(ids)} tokens; {need} requested")
    blocks = [ids[i * seq_len : (i + 1) * seq_len] for i in range(n_blocks)]
    random.Random(seed).shuffle(blocks)
    return blocks


def _split(blocks: list[list[int]], n_train: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(blocks[:n_train], dtype=torch.long),
        torch.tensor(blocks[n_train:], dtype=torch.long),
    )


def smollm2_task(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Task:
    from adacc_hf.assets import load_smollm2

    _, tok = load_smollm2(dtype=dtype)
    n_train = args.steps * args.batch_size
    blocks = text_blocks(tok, args.seq_len, n_train + args.n_eval, args.seed)

    def make() -> torch.nn.Module:
        m, _ = load_smollm2(dtype=dtype)
        m.config.use_cache = False
        return m.to(device).train()

    what = "SmolLM2-135M-Instruct (pretrained), Shakespeare fine-tuning"
    return Task(what, make, *_split(blocks, n_train))


def scratch_task(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Task:
    from adacc_hf.assets import shakespeare_text

    n_train, seq = args.scratch_steps * args.scratch_batch_size, args.seq_len
    n = n_train + args.n_eval
    data = shakespeare_text(max_chars=n * seq * 2).encode("utf-8")[: n * seq]
    blocks = [list(data[i * seq : (i + 1) * seq]) for i in range(n)]
    random.Random(args.seed).shuffle(blocks)
    cfg = transformers.GPT2Config(
        vocab_size=256,
        n_embd=args.scratch_width,
        n_layer=args.scratch_layers,
        n_head=4,
        n_positions=max(seq, 128),
        bos_token_id=None,
        eos_token_id=None,
        use_cache=False,
    )

    def make() -> torch.nn.Module:
        torch.manual_seed(args.seed)
        return transformers.GPT2LMHeadModel(cfg).to(device=device, dtype=dtype).train()

    what = (
        f"GPT-2 from scratch ({args.scratch_layers} layers x {args.scratch_width}, byte vocabulary),"
        " Shakespeare"
    )
    return Task(what, make, *_split(blocks, n_train))


def batch_of(ids: torch.Tensor, device: torch.device) -> dict[str, Any]:
    ids = ids.to(device)
    return {"input_ids": ids, "labels": ids, "use_cache": False}
