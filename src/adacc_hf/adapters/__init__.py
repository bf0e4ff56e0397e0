"""Adapters: where the blocks of a model are and what each op inside a block is."""

from .base import ATTENTION_CORE, CODEC_FOR_LAYER, LAYER_TYPES, Adapter, BlockGroup
from .generic import GenericAdapter
from .registry import (
    OVERRIDES,
    VERIFIED_MODEL_TYPES,
    get_adapter,
    supported_model_types,
    unwrap_model,
)

__all__ = [
    "ATTENTION_CORE",
    "CODEC_FOR_LAYER",
    "LAYER_TYPES",
    "OVERRIDES",
    "VERIFIED_MODEL_TYPES",
    "Adapter",
    "BlockGroup",
    "GenericAdapter",
    "get_adapter",
    "supported_model_types",
    "unwrap_model",
]
