"""Adapters: where the blocks of a model are and what each op inside a block is."""

from .base import ATTENTION_CORE, CODEC_FOR_LAYER, LAYER_TYPES, Adapter, BlockGroup, unwrap_model
from .generic import GenericAdapter
from .plain import PlainAdapter, PlainModel, plain_model
from .registry import OVERRIDES, VERIFIED_MODEL_TYPES, get_adapter, supported_model_types

__all__ = [
    "ATTENTION_CORE",
    "CODEC_FOR_LAYER",
    "LAYER_TYPES",
    "OVERRIDES",
    "VERIFIED_MODEL_TYPES",
    "Adapter",
    "BlockGroup",
    "GenericAdapter",
    "PlainAdapter",
    "PlainModel",
    "get_adapter",
    "plain_model",
    "supported_model_types",
    "unwrap_model",
]
