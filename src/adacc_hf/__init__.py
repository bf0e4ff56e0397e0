"""adacc-hf: Adacc (adaptive compression + recomputation of activations) for HuggingFace models.

Public API::

    args = AdaccTrainingArguments(..., adacc=True, adacc_memory_budget="20GiB")
    Trainer(model, args, ...).train()                   # profiles, solves, patches, trains

    session = prepare(model, "20GiB", sample_batch)     # custom loops / Accelerate
    profile = profile_model(model, batch); policy = solve_policy(profile, "20GiB")
    with apply_adacc(model, policy): ...                # any policy, reversibly
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

_LAZY = {
    # Trainer integration pulls in transformers.Trainer: import on first use only.
    "AdaccTrainingArguments": "integrations.trainer",
    "AdaccTrainer": "integrations.trainer",
    "AdaccCallback": "integrations.trainer",
    "AdaccSession": "integrations.session",
    "AdaccConfig": "integrations.session",
    "prepare": "integrations.session",
    "profile_model": "profiler",
    "Profile": "profiler",
    "solve_policy": "solver",
    "predict": "solver",
    "parse_budget": "solver",
    "estimate_static_memory": "solver",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'adacc_hf' has no attribute {name!r}")


__all__ = [
    *sorted(_LAZY),
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
