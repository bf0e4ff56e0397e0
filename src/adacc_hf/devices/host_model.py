"""A model's training step on this host without its arithmetic's cost: the model built from its
configuration with uninitialised weights, the optimizer a GPU run steps with, one training step
as a Trainer's (the output dropped before backward). Shared by the plans made for a GPU on paper
(`plan`) and a live session's reserved-memory model (`live`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["empty_model", "modelled_optimizer", "train_step"]


def empty_model(config: Any, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A transformers model of `config` on the CPU with uninitialised weights (no pages touched:
    a dry run reads none), in train mode."""
    import transformers

    cls = (
        transformers.AutoModelForSeq2SeqLM
        if getattr(config, "is_encoder_decoder", False)
        else transformers.AutoModelForCausalLM
    )
    with torch.device("meta"):
        model = cls.from_config(config, dtype=dtype)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each tied parameter storage of its own
    return model.train()


def modelled_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """The optimizer a GPU run of `name` steps with (fused or foreach AdamW, as on CUDA)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw_torch_fused":
        return torch.optim.AdamW(params, lr=1e-5, fused=True)
    if name in ("adamw_torch", "adamw"):
        return torch.optim.AdamW(params, lr=1e-5, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-5)
    raise ValueError(f"no modelled optimizer {name!r}: adamw_torch_fused, adamw_torch or sgd")


def train_step(
    model: nn.Module,
    batch: Mapping[str, Any],
    opt: torch.optim.Optimizer,
    autocast: torch.dtype | None = None,
) -> None:
    """One training step of `model` on `batch` (its forward under the host's `autocast`)."""
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        out = model(**batch)
    loss = out["loss"] if isinstance(out, Mapping) else out[0]
    del out  # the logits go before backward, as a Trainer's step drops them
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
