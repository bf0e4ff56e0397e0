"""Rule-based policies for a model: trace it, then apply one rule to every op.

uniform_policy(model, "recompute", batch)       # HF-style full activation checkpointing
uniform_policy(model, "compress", batch)        # every saved activation with its codec
attention_recompute_policy(model, batch)        # Megatron-style selective recompute
layer_type_policy(model, {"mlp_up": "compress"}, batch)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..policy import Policy, builders
from ..schema import ActionKind
from .trace import trace_model

Batch = Mapping[str, Any] | None


def uniform_policy(
    model: nn.Module,
    action: ActionKind,
    sample_batch: Batch = None,
    *,
    codecs: Mapping[str, str] | None = None,
    codec_params: Mapping[str, Mapping[str, Any]] | None = None,
    autocast: torch.dtype | None = None,
) -> Policy:
    """The same action for every op of every block of `model` (see `builders.uniform`); traced on
    `sample_batch` (default: a small dummy batch) under `autocast` (the run's mixed precision)."""
    return builders.uniform(
        trace_model(model, sample_batch, autocast),
        action,
        codecs=codecs,
        codec_params=codec_params,
    )


def layer_type_policy(
    model: nn.Module,
    actions: Mapping[str, ActionKind],
    sample_batch: Batch = None,
    *,
    default: ActionKind = "retain",
    autocast: torch.dtype | None = None,
) -> Policy:
    """One action per layer type (see `adacc_hf.schema.LAYER_TYPES`), `default` for the rest."""
    return builders.by_layer_type(
        trace_model(model, sample_batch, autocast), actions, default=default
    )


def attention_recompute_policy(
    model: nn.Module, sample_batch: Batch = None, *, autocast: torch.dtype | None = None
) -> Policy:
    """Megatron-style selective recompute of the attention core; the rest retained."""
    return builders.attention_recompute(trace_model(model, sample_batch, autocast))
