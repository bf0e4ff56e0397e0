"""Adapters by `config.model_type`."""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .base import Adapter
from .bert import BERT
from .gpt2 import GPT2
from .llama import LLAMA
from .t5 import T5

ADAPTERS: tuple[Adapter, ...] = (LLAMA, GPT2, T5, BERT)
_BY_MODEL_TYPE = {mt: a for a in ADAPTERS for mt in a.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


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
    """The adapter for a model (or a `config.model_type` string).

    Raises `UnsupportedModelError` naming the supported model types.
    """
    if isinstance(model_or_type, str):
        model_type = model_or_type
    else:
        config = getattr(unwrap_model(model_or_type), "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type is None:
            raise UnsupportedModelError(
                f"{type(model_or_type).__name__} has no `config.model_type`: adacc-hf patches "
                f"HuggingFace transformers models of types {', '.join(supported_model_types())}."
            )
    adapter = _BY_MODEL_TYPE.get(model_type)
    if adapter is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by adacc-hf; supported model types: "
            f"{', '.join(supported_model_types())}. Use one of those families, or add an adapter "
            "in adacc_hf/adapters/."
        )
    return adapter
