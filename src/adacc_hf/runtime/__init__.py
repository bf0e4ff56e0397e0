"""The runtime: trace blocks, run per-op policies inside them, measure what they hold."""

from .apply import AdaccHandle, apply_adacc
from .policies import attention_recompute_policy, layer_type_policy, uniform_policy
from .trace import dummy_batch, trace_model

__all__ = [
    "AdaccHandle",
    "apply_adacc",
    "attention_recompute_policy",
    "dummy_batch",
    "layer_type_policy",
    "trace_model",
    "uniform_policy",
]
