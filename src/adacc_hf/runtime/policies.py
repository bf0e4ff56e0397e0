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
    """The same action for every op of every block of `model` (see `builders.uniform`).

    ``"retain"`` runs every block without checkpointing; ``"recompute"`` is full activation
    checkpointing; ``"compress"`` compresses every output autograd keeps with its layer type's
    codec and recomputes the rest; ``"offload"`` holds every output autograd keeps and every
    block's input in host memory and recomputes the rest. The model is traced on
    `sample_batch` under `autocast`.

    Args:
        model: the model to trace.
        action: ``"retain"``, ``"recompute"``, ``"compress"`` or ``"offload"``.
        sample_batch: a micro-batch to trace on (default: a small dummy batch).
        codecs: ``{layer_type: codec}`` overriding a layer type's own codec (``"compress"``).
        codec_params: the codecs' parameters by codec name (e.g. ``{"int4_outlier":
            {"zscore_threshold": 3.0}}``).
        autocast: the dtype the run's forward autocasts to (its mixed precision).

    Returns:
        The `Policy`; apply it with `apply_adacc`.

    Raises:
        PolicyError: an unknown action.
    """
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
    """One action per layer type (see `adacc_hf.schema.LAYER_TYPES`), `default` for the rest.

    ``retain`` keeps only outputs autograd saves (the others are recomputed for free);
    ``compress`` uses each layer type's codec.

    Args:
        model: the model to trace.
        actions: the action of each layer type named, e.g. ``{"mlp_up": "compress"}``.
        sample_batch: a micro-batch to trace on (default: a small dummy batch).
        default: the action of the layer types `actions` does not name.
        autocast: the dtype the run's forward autocasts to (its mixed precision).

    Returns:
        The `Policy`; apply it with `apply_adacc`.

    Raises:
        PolicyError: an unknown layer type or action.
    """
    return builders.by_layer_type(
        trace_model(model, sample_batch, autocast), actions, default=default
    )


def attention_recompute_policy(
    model: nn.Module, sample_batch: Batch = None, *, autocast: torch.dtype | None = None
) -> Policy:
    """Megatron-style selective recompute of the attention core; the rest retained.

    Args:
        model: the model to trace.
        sample_batch: a micro-batch to trace on (default: a small dummy batch).
        autocast: the dtype the run's forward autocasts to (its mixed precision).

    Returns:
        The `Policy`; apply it with `apply_adacc`.
    """
    return builders.attention_recompute(trace_model(model, sample_batch, autocast))
