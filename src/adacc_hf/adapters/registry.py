"""`get_adapter`: a family override where the generic rules need one, else the generic adapter."""

from __future__ import annotations

from torch import nn

from ..errors import UnsupportedModelError
from .base import Adapter, unwrap_model
from .generic import VERIFIED_MODEL_TYPES, GenericAdapter
from .plain import plain_model
from .t5 import T5

GENERIC = GenericAdapter()
#: Family overrides by `config.model_type` (only where the generic adapter would be wrong).
OVERRIDES: dict[str, Adapter] = {"t5": T5}


def supported_model_types() -> list[str]:
    """The model types verified end to end.

    Any model whose blocks are transformers' `GradientCheckpointingLayer`s runs through the
    generic adapter, any other through ``prepare(..., blocks=...)`` (`plain`).

    Returns:
        The ``config.model_type`` names, sorted.
    """
    return sorted(VERIFIED_MODEL_TYPES)


def get_adapter(model_or_type: nn.Module | str) -> Adapter:
    """The adapter for a model (or a `config.model_type` string).

    The family's override if it has one, else the generic adapter; a plain PyTorch model whose
    blocks were named (``prepare(..., blocks=...)``) gets its own. Given a model, checks that it
    can run.

    Args:
        model_or_type: the model (or a wrapper of it), or a ``config.model_type`` string.

    Returns:
        The `Adapter`: it finds the model's blocks, groups them and names each op's layer type.

    Raises:
        UnsupportedModelError: the model cannot run (no ``config.model_type`` and no named
            blocks, no `GradientCheckpointingLayer` blocks, or MoE experts on the eager
            implementation); the message says what to change.
    """
    if isinstance(model_or_type, str):
        return OVERRIDES.get(model_or_type, GENERIC)
    base = unwrap_model(model_or_type)
    plain = plain_model(base)
    if plain is not None:  # blocks named by the user (`plain.register`)
        return plain.adapter
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"{type(base).__name__} has no `config.model_type`: adacc-hf patches transformers "
            "models whose blocks are GradientCheckpointingLayers (verified: "
            f"{', '.join(supported_model_types())}); for any other PyTorch model name its "
            "repeated blocks: adacc_hf.prepare(model, budget, batch, blocks='layers.*', "
            "loss=...) (docs/families.md)."
        )
    adapter = OVERRIDES.get(model_type, GENERIC)
    adapter.check(base)
    return adapter
