"""The LM head and loss, measured alone for each way of running it (`schema.HEADS`).

The step timeline (`memory`) measures one head inside the step; this measures the head + loss
alone on final hidden states of the batch's shape, batch labels and autocast, once per way (the
model's own ``[tokens x vocab]`` logits and HF loss, and the chunked head where the model can take
it): what its forward leaves held, its forward and backward peaks (bytes above the level when it
starts, by `runtime.peak.AllocationTracker`) and its forward + backward time. The step model
(`solver.step`) moves the timeline's head moments by the difference between the chosen way and the
model's own.

Inside a budget (`room`: the bytes profiling may add), the model's own head runs first on a slice
of the sequence (1/16 of it). Every allocation of it is affine in the tokens with non-negative
terms (logits and their gradient grow with them, the weight's gradient does not), so at any moment
the level on ``N`` tokens is at most ``N / n`` times the level on ``n``: scaled from a slice, the
peak is an upper bound. If that bound on the whole batch fits `room` the head runs on the whole
batch; else once more on the longest slice whose bound fits, and keeps that slice's costs scaled
up (`scaled`). The chunked head holds one ``[chunk x vocab]`` block at a time whatever the
tokens, so it runs on one and two of the whole batch's chunks first and its costs are continued
affinely (`extrapolate`); it runs whole where that fits. The hidden states are drawn from a
private generator, not computed: bytes and times do not depend on them, and no extra forward of
the model runs.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..runtime.context import autocast_context, train_mode
from ..runtime.head import chunked_causal_lm_loss, chunked_head_problem
from ..runtime.head_loss import default_chunk_rows
from ..runtime.peak import AllocationTracker
from ..runtime.timing import time_call
from ..schema import HeadCost

logger = logging.getLogger("adacc_hf")

#: The slice of the sequence a head is measured on first, inside a budget (a fraction).
FIRST_SLICE = 1 / 16
#: Kept above the affine continuation of the model's own head when only its fit is in question:
#: its bytes are affine in the tokens (logits, their loss terms and gradients), the margin is for
#: allocations that round.
AFFINE_MARGIN = 0.05


def head_losses(
    base: nn.Module, head: nn.Linear, labels: torch.Tensor, chunk_rows: int
) -> dict[str, Callable]:
    def full(x: torch.Tensor) -> torch.Tensor:
        # the logits stay alive through the loss, as the model's forward keeps them (it returns
        # them): the timeline's loss peak has them beside the loss's own upcast and log-probs
        logits = head(x)
        return base.loss_function(logits, labels[:, : x.shape[1]], head.out_features)

    def chunked(x: torch.Tensor) -> torch.Tensor:  # the whole batch's chunks on any slice
        return chunked_causal_lm_loss(head, x, labels[:, : x.shape[1]], chunk_rows=chunk_rows)

    return {"full": full, "chunked": chunked}


def head_hidden(head: nn.Linear, labels: torch.Tensor) -> torch.Tensor:
    """Final hidden states of the batch's shape in the head's dtype, from a private generator."""
    w = head.weight
    g = torch.Generator(w.device).manual_seed(0)
    shape = (*labels.shape, head.in_features)
    return torch.randn(shape, generator=g, device=w.device, dtype=w.dtype)


def head_cost(
    fn: Callable, x: torch.Tensor, params: list[torch.Tensor], amp: Any, repeats: int
) -> HeadCost:
    """One way's `HeadCost` on hidden states `x` (`amp`: a factory of the autocast context;
    ``repeats=0``: bytes only)."""
    x = x.detach().requires_grad_()
    device = x.device
    tracker = AllocationTracker(device)
    with tracker:
        with amp():
            loss = fn(x)
        tracker.mark("forward_end")
        grads = torch.autograd.grad(loss, [x, *params])
        del loss, grads

    def step() -> None:
        with amp():
            loss = fn(x)
        torch.autograd.grad(loss, [x, *params])

    return HeadCost(
        held=max(0, tracker.level("forward_end")),
        forward_peak=tracker.peak(None, "forward_end"),
        backward_peak=tracker.peak("forward_end", None),
        ms=time_call(step, device, repeats) if repeats else 0.0,
    )


def scaled(cost: HeadCost, factor: float) -> HeadCost:
    """`cost` measured on ``n`` tokens, as an upper bound on ``factor * n`` tokens (factor >= 1)."""
    return HeadCost(
        held=math.ceil(cost.held * factor),
        forward_peak=math.ceil(cost.forward_peak * factor),
        backward_peak=math.ceil(cost.backward_peak * factor),
        ms=cost.ms * factor,
    )


def extrapolate(a: HeadCost, b: HeadCost, na: int, nb: int, n: int) -> HeadCost:
    """The affine continuation through (`na`, `a`) and (`nb`, `b`) to `n` tokens, never below
    `b`."""

    def at(u: float, v: float) -> float:
        return max(v, v + (v - u) * (n - nb) / (nb - na))

    return HeadCost(
        held=math.ceil(at(a.held, b.held)),
        forward_peak=math.ceil(at(a.forward_peak, b.forward_peak)),
        backward_peak=math.ceil(at(a.backward_peak, b.backward_peak)),
        ms=at(a.ms, b.ms),
    )


def head_peak(cost: HeadCost) -> int:
    return max(cost.forward_peak, cost.backward_peak)


def lm_head(
    base: nn.Module, batch: Mapping[str, Any]
) -> tuple[nn.Linear, torch.Tensor, list[torch.Tensor]] | None:
    """(the LM head, the batch's labels on its device, its trainable parameters) of a model
    whose head can run alone (`runtime.head.chunked_head_problem`), or None (no separate head,
    or a batch without labels)."""
    lm = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    labels = batch.get("labels")
    if chunked_head_problem(base) is not None or not isinstance(labels, torch.Tensor):
        return None
    assert isinstance(lm, nn.Linear)
    params = [p for p in lm.parameters() if p.requires_grad]
    return lm, labels.to(lm.weight.device), params


def measure_heads(
    base: nn.Module,
    batch: Mapping[str, Any],
    autocast: torch.dtype | None = None,
    repeats: int = 3,
    room: int | None = None,
    head: str = "auto",
    rest_nbytes: int = 0,
) -> dict[str, HeadCost]:
    """`HeadCost` per way of running `base`'s LM head and loss on `batch` (empty for a model that
    cannot take the chunked head, e.g. a seq2seq or masked LM, or a batch without labels); within
    `room` bytes (None: no limit), see the module docstring.

    For a run that keeps the model's own head (``head="full"``) nothing is there to choose: empty
    too, unless the timeline may not fit `room` with it (what the run holds besides the head,
    `rest_nbytes`, plus the head's peak continued from two slices, bytes only, `AFFINE_MARGIN`
    above); then every way, as the timeline runs the chunked head and is moved back by their
    difference."""
    found = lm_head(base, batch)
    if found is None:
        return {}  # one way only (the model's own, in the timeline): nothing to choose
    if head == "full" and room is None:
        return {}  # the timeline runs the model's own head whatever it holds
    lm, labels, params = found
    device = lm.weight.device
    rows, length = labels.shape[0], labels.shape[-1]
    chunk = default_chunk_rows(rows * length, lm.in_features, lm.out_features, device)
    first = {"full": max(1, round(length * FIRST_SLICE)), "chunked": -(-chunk // rows)}

    losses = head_losses(base, lm, labels, chunk)

    def amp() -> Any:
        return autocast_context(device, autocast)

    def cost(fn: Callable, n: int) -> HeadCost:
        return head_cost(fn, hidden[:, :n], params, amp, repeats)

    out: dict[str, HeadCost] = {}
    with train_mode(base):
        hidden = head_hidden(lm, labels)
        n = first["full"]
        if head == "full" and 2 * n < length:  # the affine continuation of two slices, bytes only
            a, b = (head_cost(losses["full"], hidden[:, :k], params, amp, 0) for k in (n, 2 * n))
            bound = extrapolate(a, b, n, 2 * n, length)
            if rest_nbytes + math.ceil(head_peak(bound) * (1 + AFFINE_MARGIN)) <= room:
                return out
        for name, fn in losses.items():
            n = first[name]
            if room is None or (2 if name == "chunked" else 1) * n >= length:
                out[name] = cost(fn, length)
                continue
            if name == "chunked":
                bound = extrapolate(
                    cost(fn, n), cost(fn, 2 * n), rows * n, 2 * rows * n, rows * length
                )
            else:
                small = cost(fn, n)
                bound = scaled(small, length / n)
                if head_peak(bound) > room:  # the longest slice whose bound fits
                    n = max(n, min(length - 1, n * room // max(1, head_peak(small))))
                    bound = scaled(cost(fn, n) if n > first[name] else small, length / n)
            if head_peak(bound) <= room:
                out[name] = cost(fn, length)
                continue
            out[name] = bound
            logger.info(
                "adacc: the %s LM head on the whole batch would pass the %.1f MiB profiling may "
                "use: measured on slices and continued (%.1f MiB)",
                name, room / 2**20, head_peak(bound) / 2**20,
            )  # fmt: skip
    return out
