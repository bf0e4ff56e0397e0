"""`prepare`: Adacc for custom training loops and Accelerate."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from ..adapters import plain, unwrap_model
from ..engine.autobatch import choose_micro_batch
from ..engine.config import AdaccConfig
from ..engine.facts import FACTS, RunFacts, loop_facts
from ..engine.options import SessionOptions
from ..engine.session import AdaccSession
from ..engine.shapes import rows
from ..errors import AdaccError
from ..policy import Policy

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
    optimizer: torch.optim.Optimizer | str | None = None,
    gradient_accumulation_steps: int | None = None,
    run: RunFacts | None = None,
    **options: Unpack[SessionOptions],
) -> AdaccSession:
    """Adacc for custom loops and Accelerate: profile, solve and patch `model`.

    With `sample_batch` this happens now; without, on the model's first training forward. A saved
    `policy` (object or JSON path) skips profiling. With ``adaptive=True`` (the default, as in the
    Trainer) call ``session.step_done(step)`` after each optimizer step: the rectifier re-measures
    the codecs on tracking steps and switches policy when needed; ``adaptive=False`` keeps the
    first policy. Undo with ``session.close()``.

    The facts of the run are read off it (`RunFacts.from_loop`): the optimizer's states from the
    `optimizer` the loop steps, the accumulation from `gradient_accumulation_steps` or an
    initialised ``Accelerator``, DDP and sharding (ZeRO-3, FSDP2, a DeepSpeed engine) from the
    model and the process group, and the autocast from the first training forward; `run` states
    them instead. In a process group of several ranks, call it on every rank: all profile, rank 0
    solves, and every rank runs (and later switches to) rank 0's policy.

    ``auto_batch_size=True`` (needs `sample_batch`) also picks the micro-batch: the divisor of
    `global_batch` (default: `sample_batch`'s rows x the accumulation) with the best predicted
    tokens/s whose step fits the budget (`autobatch.choose_micro_batch`). Build your batches of
    ``session.micro_batch`` rows and accumulate ``session.accumulation`` of them per optimizer
    step; ``session.batch_choice`` holds every candidate.

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
        codecs: the codecs profiled per op (default: each layer type's own; `CodecOptions`).
        adaptive: re-measure codecs and switch policy on tracking steps (``session.step_done``).
        auto_batch_size: also choose the micro-batch (needs `sample_batch`).
        global_batch: rows per optimizer step for `auto_batch_size`.
        blocks: the repeated blocks of a plain PyTorch model: a path pattern (``"layers.*"``,
            ``"transformer.h.*"``: ``*`` matches one path component), a container
            (``model.layers``), or a list of modules, paths or patterns. None: transformers'
            `GradientCheckpointingLayer` blocks.
        loss: ``loss(output, batch) -> scalar tensor`` when the model returns no loss (e.g.
            ``lambda out, batch: F.cross_entropy(out, batch["labels"])``).
        optimizer: the optimizer the loop steps (or a name of
            `solver.static.KNOWN_OPTIMIZERS`): its states are in the step's peak (None:
            ``"adamw_torch"``'s).
        gradient_accumulation_steps: micro-batches per optimizer step (None: an initialised
            ``Accelerator``'s, else 1).
        run: the facts of the run (`RunFacts`) where they cannot be read off it (nothing is then
            read; `optimizer` and `gradient_accumulation_steps`, given, still count).
        **options: any other option by its name (`engine.options.SessionOptions`:
            ``max_seq_len=``, ``headroom=``, ``head=``, ``offload=``, ...; each group's
            ``help()``, e.g. ``help(adacc_hf.MemoryOptions)``, says what they do). A fact of the
            run by its name (``zero_stage=``, ``mixed_precision=``, ...) still works for one
            release, with an `AdaccFutureWarning`.

    Returns:
        The `AdaccSession` (``session.step_done(step)`` after each optimizer step,
        ``session.close()`` undoes the patch).

    Raises:
        UnsupportedModelError: bad `blocks` or `loss` (no module matches, blocks of one class
            that differ in structure, a block the forward does not call), or (with
            `sample_batch`) a model no adapter runs; the message says what to change.
        AdaccError: an option its group refuses, a fact given both in `run` and by name, or
            ``auto_batch_size=True`` without `sample_batch` or with `blocks` / `loss`.
        BudgetError: with `sample_batch`: a malformed budget, or no policy fits in it (the
            message says what dominates the step).
        PolicyError: a `policy` path that does not hold a readable policy, or (with
            `sample_batch`) a policy made for another model.
    """
    if auto_batch_size and (blocks is not None or loss is not None):
        raise AdaccError(
            "prepare(auto_batch_size=True) does not take blocks= / loss= yet: choose the "
            "micro-batch yourself"
        )
    plain.declare(unwrap_model(model), blocks, loss)
    if isinstance(policy, str):
        policy = Policy.load(policy)
    cfg = AdaccConfig(
        budget,
        codecs=list(codecs) if codecs is not None else None,
        adaptive=adaptive,
        auto_batch_size=auto_batch_size,
        run=loop_facts(model, optimizer, gradient_accumulation_steps, run, options),
        **{k: v for k, v in options.items() if k not in FACTS},
    )
    choice = None
    if cfg.memory.auto_batch_size and policy is None:
        if sample_batch is None:
            raise AdaccError("prepare(auto_batch_size=True) needs a sample_batch")
        if global_batch is None:
            global_batch = len(next(v for v in sample_batch.values() if isinstance(v, Tensor)))
            global_batch *= cfg.run.gradient_accumulation_steps
        choice = choose_micro_batch(model, sample_batch, cfg, global_batch)
        sample_batch = rows(sample_batch, choice.micro_batch)
    session = AdaccSession(model, cfg, policy=policy, choice=choice)
    session.start(sample_batch)
    return session
