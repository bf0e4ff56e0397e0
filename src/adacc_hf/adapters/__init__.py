"""Per-family adapters: where the blocks of a model are and what each op inside a block is."""

from .base import ATTENTION_CORE, CODEC_FOR_LAYER, LAYER_TYPES, Adapter, BlockGroup
from .registry import ADAPTERS, get_adapter, supported_model_types, unwrap_model

__all__ = [
    "ADAPTERS",
    "ATTENTION_CORE",
    "CODEC_FOR_LAYER",
    "LAYER_TYPES",
    "Adapter",
    "BlockGroup",
    "get_adapter",
    "supported_model_types",
    "unwrap_model",
]
