"""What CUDA's caching allocator would reserve for a live session's plan, before its step runs.

A session's step model predicts allocated bytes; CUDA runs out when *reserved* ones do not fit
(`devices.reserved`). For a plan about to train, `ReservedModel` runs the plan's training step dry
(`dryrun`: no arithmetic, every allocation made) on a mirror of the model built from its
configuration on this host, with uninitialised weights, and replays the step's allocations through
the caching-allocator model (`caching_allocator`): the planner keeps what the allocator reserves
above the allocated peak free and solves again where the reserved peak would pass the budget
(`engine.planner`). The guard still reads what the device really reserved after each step and
re-plans on what the model missed (`engine.guard`).

The mirror is a transformers model of the same configuration, the same dtypes and the same
trainable parameters (by name); a model it cannot mirror that way (PEFT adapters, quantized
weights, a model that is not a transformers class) is left to the guard, with one log line. The
dry step runs on the host under the autocast the session plans under (the host's autocast, whose
op lists are close to CUDA's), with the run's optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..runtime import apply_adacc
from .dryrun import dry_run
from .host_model import empty_model, modelled_optimizer, train_step
from .reserved import step_reserved

__all__ = ["ReservedModel", "mirror_of"]

logger = logging.getLogger("adacc_hf")


def mirror_of(model: nn.Module) -> nn.Module | None:
    """`model`'s mirror on the host (module docstring), or None where it cannot be built."""
    config = getattr(model, "config", None)
    if config is None or hasattr(model, "peft_config") or getattr(model, "is_quantized", False):
        return None
    try:
        dtype = next(model.parameters()).dtype
        mirror = empty_model(config, dtype)
    except Exception as e:  # a configuration the auto classes do not build
        logger.debug("adacc: no host mirror of %s: %s", type(model).__name__, e)
        return None
    if type(mirror) is not type(model):
        return None
    theirs = dict(model.named_parameters())
    ours = dict(mirror.named_parameters())
    if theirs.keys() != ours.keys():
        return None
    for name, p in ours.items():
        q = theirs[name]
        if p.shape != q.shape:
            return None
        if p.dtype != q.dtype:
            p.data = torch.empty(p.shape, dtype=q.dtype)
        p.requires_grad_(q.requires_grad)
    return mirror


def _on_host(batch: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.to("cpu") if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _optimizer(model: nn.Module, name: str | None) -> torch.optim.Optimizer:
    try:
        return modelled_optimizer(model, name or "adamw_torch")
    except ValueError:  # another optimizer: AdamW's states are the common case
        return modelled_optimizer(model, "adamw_torch")


class ReservedModel:
    """A live session's model of what its plans would reserve (module docstring).

    Args:
        model: the trained model (a transformers model; others are not mirrored).
        expandable: model CUDA's allocator with expandable segments, or its default.
        optimizer: the run's optimizer name (``adamw_torch_fused``, ``adamw_torch``, ``sgd``).
        autocast: the autocast dtype the step's forward runs under (None: none).
    """

    def __init__(
        self,
        model: nn.Module,
        expandable: bool,
        optimizer: str | None = None,
        autocast: torch.dtype | None = None,
    ) -> None:
        self.expandable = expandable
        self.optimizer, self.autocast = optimizer, autocast
        self.mirror = mirror_of(model)
        if self.mirror is None:
            logger.info(
                "adacc: %s is not mirrored on the host (PEFT, quantized, or not a transformers "
                "model): its plans count allocated bytes, and the guard re-plans on what CUDA "
                "reserves after a step",
                type(model).__name__,
            )

    def peaks(self, policy: Any, batch: Mapping[str, Any]) -> tuple[int, int] | None:
        """The allocated (bytes asked for) and reserved peaks of one training step of `batch`
        under `policy`, after one step made the optimizer's states and left no gradients, as a
        run's steps follow each other (None: no mirror, or the dry step failed: logged)."""
        if self.mirror is None:
            return None
        mirror, host = self.mirror, _on_host(batch)
        opt = _optimizer(mirror, self.optimizer)
        tensors = [v for v in host.values() if isinstance(v, torch.Tensor)]
        try:
            with dry_run(), torch.random.fork_rng(devices=[]), apply_adacc(mirror, policy):
                train_step(mirror, host, opt, self.autocast)  # the optimizer's states exist
                peaks = step_reserved(
                    mirror,
                    lambda: train_step(mirror, host, opt, self.autocast),
                    opt,
                    tensors,
                    expandable=self.expandable,
                )
        except Exception as e:  # a model the dry run cannot step: the guard is left
            logger.info("adacc: the reserved peak was not modelled (%s: %s)", type(e).__name__, e)
            self.mirror = None
            return None
        return peaks.requested, peaks.reserved
