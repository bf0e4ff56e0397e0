"""`prepare`: Adacc for custom training loops and Accelerate."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from ..policy import Policy
from .config import AdaccConfig
from .session import AdaccSession
from .sharding import sharding_from_model

__all__ = ["prepare"]


def prepare(
    model: nn.Module,
    budget: int | str = "auto",
    sample_batch: Mapping[str, Any] | None = None,
    *,
    policy: Policy | str | None = None,
    codecs: Iterable[str] | None = None,
    adaptive: bool = True,
    **config: Any,
) -> AdaccSession:
    """Adacc for custom loops and Accelerate: profile, solve and patch `model`.

    With `sample_batch` this happens now; without, on the model's first training forward. A saved
    `policy` (object or JSON path) skips profiling. With ``adaptive=True`` (the default, as in the
    Trainer) call ``session.step_done(step)`` after each optimizer step: the rectifier re-measures
    the codecs on tracking steps and switches policy when needed; ``adaptive=False`` keeps the
    first policy. Undo with ``session.close()``.

    In a process group of several ranks, call it on every rank: all profile, rank 0 solves, and
    every rank runs (and later switches to) rank 0's policy. ZeRO-3 and FSDP2 sharding is read off
    the model's parameters unless `zero_stage` / `fsdp` / `world_size` are given.
    """
    if isinstance(policy, str):
        policy = Policy.load(policy)
    if not config.keys() & {"zero_stage", "fsdp", "world_size", "offload_optimizer"}:
        config = {**sharding_from_model(model), **config}
    cfg = AdaccConfig(
        budget=budget,
        codecs=list(codecs) if codecs is not None else None,
        adaptive=adaptive,
        **config,
    )
    session = AdaccSession(model, cfg, policy=policy)
    if sample_batch is not None:
        session.setup(sample_batch)
        session.on_step_begin(1)
    else:
        session.attach()
    return session
