"""The runtime: trace blocks, run per-op policies inside them, measure what they hold."""

from .apply import AdaccHandle, apply_adacc
from .trace import ModelTrace, dummy_batch, trace_model

__all__ = ["AdaccHandle", "ModelTrace", "apply_adacc", "dummy_batch", "trace_model"]
