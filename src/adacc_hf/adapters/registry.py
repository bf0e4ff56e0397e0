"""`get_adapter`: a family override where the generic rules need one, else the generic adapter."""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .base import Adapter
from .generic import VERIFIED_MODEL_TYPES, GenericAdapter
from .t5 import T5

GENERIC = GenericAdapter()
#: Family overrides by `config.model_type` (only where the generic adapter would be wrong).
OVERRIDES: dict[str, Adapter] = {"t5": T5}


def supported_model_types() -> list[str]:
    """The model types verified end to end; any model whose blocks are transformers'
    `GradientCheckpointingLayer`s runs through the generic adapter."""
    return sorted(VERIFIED_MODEL_TYPES)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside PEFT, DDP, DeepSpeed, FSDP1 and `torch.compile` wrappers
    (``get_base_model()``, ``.module``, ``._orig_mod``, repeatedly)."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
    return model


def get_adapter(model_or_type: nn.Module | str) -> Adapter:
    """The adapter for a model (or a `config.model_type` string): the family's override if it
    has one, else the generic adapter.

    Given a model, checks that it can run (raises `UnsupportedModelError` saying what to change).
    """
    if isinstance(model_or_type, str):
        return OVERRIDES.get(model_or_type, GENERIC)
    base = unwrap_model(model_or_type)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"{type(base).__name__} has no `config.model_type`: adacc-hf patches transformers "
            "models whose blocks are GradientCheckpointingLayers (verified: "
            f"{', '.join(supported_model_types())})."
        )
    adapter = OVERRIDES.get(model_type, GENERIC)
    adapter.check(base)
    return adapter
