"""`prepare`: Adacc for custom training loops and Accelerate."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor, nn
from typing_extensions import Unpack

from ..adapters import plain
from ..engine.autobatch import choose_micro_batch, rows
from ..engine.config import AdaccConfig
from ..engine.options import SessionOptions
from ..engine.session import AdaccSession
from ..engine.sharding import sharding_from_model
from ..errors import AdaccError
from ..policy import Policy
from ..solver.static import optimizer_name

__all__ = ["prepare"]


def prepare(
    model: nn.Module,
    budget: int | str = "auto",
    sample_batch: Mapping[str, Any] | None = None,
    *,
    policy: Policy | str | None = None,
    codecs: Iterable[str] | None = None,
    adaptive: bool = True,
    auto_batch_size: bool = False,
    global_batch: int | None = None,
    blocks: plain.BlocksSpec | None = None,
    loss: plain.LossFn | None = None,
    **config: Unpack[SessionOptions],
) -> AdaccSession:
    """Adacc for custom loops and Accelerate: profile, solve and patch `model`.

    With `sample_batch` this happens now; without, on the model's first training forward. A saved
    `policy` (object or JSON path) skips profiling. With ``adaptive=True`` (the default, as in the
    Trainer) call ``session.step_done(step)`` after each optimizer step: the rectifier re-measures
    the codecs on tracking steps and switches policy when needed; ``adaptive=False`` keeps the
    first policy. Undo with ``session.close()``. ``optimizer=`` takes the loop's optimizer
    object (or a name of `solver.static.KNOWN_OPTIMIZERS`): its states are in the step's peak.

    In a process group of several ranks, call it on every rank: all profile, rank 0 solves, and
    every rank runs (and later switches to) rank 0's policy. ZeRO-3 and FSDP2 sharding is read off
    the model's parameters unless `zero_stage` / `fsdp` / `world_size` are given.

    ``auto_batch_size=True`` (needs `sample_batch`) also picks the micro-batch: the divisor of
    `global_batch` (default: `sample_batch`'s rows x ``gradient_accumulation_steps``) with the best
    predicted tokens/s whose step fits the budget (`autobatch.choose_micro_batch`). Build your
    batches of ``session.micro_batch`` rows and accumulate ``session.accumulation`` of them per
    optimizer step; ``session.batch_choice`` holds every candidate.

    **Any PyTorch model with repeated blocks** (not a transformers model): name the blocks with
    `blocks`, and give `loss` where the model's output is not its loss. Blocks of one class share
    one profile; batches are mappings of the forward's arguments by name (plus what `loss`
    reads) and are never padded: each batch shape gets its own plan. Before any profiling, one
    forward of the sample (or first) batch without gradients checks that every block runs once
    and the loss is a scalar (`runtime.plain.check_forward`). See docs/families.md.

    Args:
        model: the model to patch (or a wrapper of it: DDP, PEFT, Accelerate).
        budget: the step's memory budget per device: bytes, ``"20GiB"``, ``"20GB"``, ``"80%"``
            of device memory or ``"auto"`` (see `parse_budget`).
        sample_batch: a training micro-batch to plan on now (None: the first training forward's).
        policy: a saved policy (object or JSON path) to run as it is.
        codecs: the codecs profiled per op (default: each layer type's own).
        adaptive: re-measure codecs and switch policy on tracking steps (``session.step_done``).
        auto_batch_size: also choose the micro-batch (needs `sample_batch`).
        global_batch: rows per optimizer step for `auto_batch_size`.
        blocks: the repeated blocks of a plain PyTorch model: a path pattern (``"layers.*"``,
            ``"transformer.h.*"``: ``*`` matches one path component), a container
            (``model.layers``), or a list of modules, paths or patterns. None: transformers'
            `GradientCheckpointingLayer` blocks.
        loss: ``loss(output, batch) -> scalar tensor`` when the model returns no loss (e.g.
            ``lambda out, batch: F.cross_entropy(out, batch["labels"])``).
        **config: any other `AdaccConfig` field by name (typed: `engine.options.SessionOptions`;
            ``optimizer=`` the loop's optimizer or its name, ``mixed_precision=``,
            ``max_seq_len=``, ``headroom=``, ...; ``help(adacc_hf.AdaccConfig)`` says what each
            does).

    Returns:
        The `AdaccSession` (``session.step_done(step)`` after each optimizer step,
        ``session.close()`` undoes the patch).

    Raises:
        UnsupportedModelError: bad `blocks` or `loss` (no module matches, blocks of one class
            that differ in structure, a block the forward does not call), or (with
            `sample_batch`) a model no adapter runs; the message says what to change.
        AdaccError: an option `AdaccConfig` refuses, or ``auto_batch_size=True`` without
            `sample_batch` or with `blocks` / `loss`.
        BudgetError: with `sample_batch`: a malformed budget, or no policy fits in it (the
            message says what dominates the step).
        PolicyError: a `policy` path that does not hold a readable policy, or (with
            `sample_batch`) a policy made for another model.
    """
    if blocks is not None or loss is not None:
        plain.register(model, blocks, loss)
        if auto_batch_size:
            raise AdaccError(
                "prepare(auto_batch_size=True) does not take blocks= / loss= yet: choose the "
                "micro-batch yourself"
            )
    else:
        plain.unregister(model)  # an earlier prepare's blocks no longer apply
    if config.get("optimizer") is not None and not isinstance(config["optimizer"], str):
        config["optimizer"] = optimizer_name(config["optimizer"])  # the object the loop steps
    if isinstance(policy, str):
        policy = Policy.load(policy)
    if not config.keys() & {"zero_stage", "fsdp", "world_size", "offload_optimizer"}:
        config = {**sharding_from_model(model), **config}
    cfg = AdaccConfig(
        budget=budget,
        codecs=list(codecs) if codecs is not None else None,
        adaptive=adaptive,
        auto_batch_size=auto_batch_size,
        **config,
    )
    if cfg.auto_batch_size and policy is None:
        if sample_batch is None:
            raise AdaccError("prepare(auto_batch_size=True) needs a sample_batch")
        return _prepare_auto(model, cfg, sample_batch, global_batch)
    session = AdaccSession(model, cfg, policy=policy)
    if sample_batch is not None:
        session.setup(sample_batch)
        session.on_step_begin(1)
    # every training forward plans its batch's bucket first (a longer batch than the sample's
    # gets a plan of its own; a bucket the guard marked gets re-planned)
    session.attach()
    return session


def _prepare_auto(
    model: nn.Module, cfg: AdaccConfig, sample: Mapping[str, Any], global_batch: int | None
) -> AdaccSession:
    """`prepare` with the automatic micro-batch: choose, then start on the chosen plan."""
    if global_batch is None:
        global_batch = len(next(iter(v for v in sample.values() if isinstance(v, Tensor))))
        global_batch *= cfg.gradient_accumulation_steps
    choice = choose_micro_batch(model, sample, cfg, global_batch)
    cfg = dataclasses.replace(cfg, gradient_accumulation_steps=choice.accumulation)
    session = AdaccSession(
        model, cfg, policy=choice.policy, profile=choice.profile, profiles=choice.profiles
    )
    session.micro_batch, session.accumulation = choice.micro_batch, choice.accumulation
    session.batch_choice = choice
    session.events.append(choice.event())
    session.setup(rows(sample, choice.micro_batch))
    session.on_step_begin(1)
    session.attach()
    return session
