"""The training-forward hook: before each training forward of the model, the session plans the
batch's bucket (the first batch of a bucket is profiled and solved) and switches the model to its
plan. Evaluation forwards and the session's own (profiling, measuring) pass untouched."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..adapters.forward import call_batch
from ..runtime.checkpoint import own_eager_runs
from ..runtime.quantized import check_trainable

__all__ = ["install_planning_hook"]


def install_planning_hook(session: Any) -> Any:
    """Register the planning hook of `session` (an `AdaccSession`, which imports this module) on
    its model; returns torch's removable handle."""
    model = session.model
    quantized = [p for p in model.parameters() if hasattr(p, "quant_state")]

    def before_forward(module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not module.training or session.ctx.planning:  # evaluation, or our own forwards
            return None
        # A training forward builds no KV cache: asked for by the config's default, each
        # checkpointed layer would drop it with transformers' "Caching is incompatible with
        # gradient checkpointing" warning, though the user enabled no checkpointing.
        config = getattr(module, "config", None)  # none on a plain PyTorch model
        if kwargs.get("use_cache") is None and getattr(config, "use_cache", False):
            kwargs["use_cache"] = False
        batch = call_batch(module, args, kwargs)
        session.oom.check()
        if any(getattr(p.quant_state, "packing_format_for_cpu", False) for p in quantized):
            check_trainable(model)  # bitsandbytes' inference repack: no backward
        if session.config.run.autocast is None and not session.fixed:
            session.planner.follow_autocast()
        with own_eager_runs():
            if session.current is None or not session.active:
                session.setup(batch, forward=True)
            else:
                session.use(session.plan(batch))
        session.derived_check.step_uses(session.current, session.device)
        head = session.handle.head if session.handle is not None else None
        if head is not None:  # installed in this hook: torch will not call its pre-hook now
            head.arm(module, kwargs)
        return args, kwargs

    # Under torch.compile the hook runs eagerly (a graph break before the model): planning
    # profiles, solves and patches, none of which a compiled graph may trace.
    return model.register_forward_pre_hook(torch.compiler.disable(before_forward), with_kwargs=True)
