"""adacc-hf: Adacc (adaptive compression + recomputation of activations) for HuggingFace models.

Public API::

    Trainer(..., callbacks=[AdaccCallback(budget="20GiB")])    # any TrainingArguments (TRL too)
    Trainer(args=AdaccTrainingArguments(..., adacc=True, adacc_budget="20GiB"))

    session = prepare(model, "20GiB", sample_batch)          # custom loops / Accelerate
    profile = profile_model(model, batch); policy = solve_policy(profile, "20GiB")
    with apply_adacc(model, policy): ...                     # any policy, reversibly
    measure_activation_memory(model, batch)                  # bytes held for backward

Heavy parts (the Trainer integration, the profiler, the solver) load on first use.
"""

from ._version import __version__
from .adapters import get_adapter, supported_model_types, unwrap_model
from .errors import (
    AdaccError,
    AlreadyAppliedError,
    BudgetError,
    PolicyError,
    UnsupportedModelError,
)
from .policy import Policy
from .runtime import (
    AdaccHandle,
    apply_adacc,
    attention_recompute_policy,
    layer_type_policy,
    trace_model,
    uniform_policy,
)
from .runtime import allocator as _allocator
from .runtime.memory import ActivationMemory, activation_memory_report, measure_activation_memory
from .runtime.peak import StepPeak, measure_step_peak
from .schema import Action, OpSpec, Profile
from .verbosity import install as _install_logging
from .verbosity import set_verbosity

_LAZY = {
    # The Trainer integration pulls in transformers.Trainer: import on first use only.
    "AdaccTrainingArguments": "integrations.arguments",
    "AdaccTrainer": "integrations.trainer",
    "AdaccCallback": "integrations.callback",
    "AdaccSession": "engine.session",
    "AdaccConfig": "engine.config",
    # its option groups and the facts of the run
    "MemoryOptions": "engine.options",
    "CodecOptions": "engine.options",
    "OffloadOptions": "engine.options",
    "CompileOptions": "engine.options",
    "SolverOptions": "engine.options",
    "TrackingOptions": "engine.options",
    "RunFacts": "engine.facts",
    "prepare": "integrations.prepare",
    "profile_model": "profiler",
    "solve": "solver",
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
    "BudgetError",
    "OpSpec",
    "Policy",
    "PolicyError",
    "Profile",
    "StepPeak",
    "UnsupportedModelError",
    "__version__",
    "activation_memory_report",
    "apply_adacc",
    "attention_recompute_policy",
    "get_adapter",
    "layer_type_policy",
    "measure_activation_memory",
    "measure_step_peak",
    "set_verbosity",
    "supported_model_types",
    "trace_model",
    "uniform_policy",
    "unwrap_model",
]

_install_logging()

# CUDA's allocator: expandable segments before CUDA starts, unless the user configured it
# (`runtime.allocator`; ADACC_CUDA_ALLOCATOR=default opts out).
_allocator.at_import()
