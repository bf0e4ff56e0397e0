"""adacc-hf: Adacc (adaptive compression + recomputation of activations) for HuggingFace models.

Public API::

    policy = Policy.uniform(model, "compress", batch)   # or attention_recompute / solver
    with apply_adacc(model, policy):
        loss = model(**batch).loss; loss.backward()
    measure_activation_memory(model, batch)             # bytes held for backward
"""

__version__ = "0.1.0"

from .adapters import get_adapter, supported_model_types
from .errors import (
    AdaccError,
    AlreadyAppliedError,
    PolicyError,
    UnsupportedModelError,
)
from .policy import Action, Policy
from .runtime import AdaccHandle, apply_adacc, trace_model
from .runtime.memory import (
    ActivationMemory,
    activation_memory_report,
    measure_activation_memory,
    peak_step_memory,
)

__all__ = [
    "Action",
    "ActivationMemory",
    "AdaccError",
    "AdaccHandle",
    "AlreadyAppliedError",
    "Policy",
    "PolicyError",
    "UnsupportedModelError",
    "__version__",
    "activation_memory_report",
    "apply_adacc",
    "get_adapter",
    "measure_activation_memory",
    "peak_step_memory",
    "supported_model_types",
    "trace_model",
]
