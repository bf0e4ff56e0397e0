"""The LM head and loss, measured alone for each way of running it (`schema.HEADS`).

The step timeline (`memory`) measures the model's own head inside the step; this measures the
head + loss alone on the same final hidden states, batch and autocast, once per way (the model's
own ``[tokens x vocab]`` logits and HF loss, and the chunked head where the model can take it):
what its forward leaves held, its forward and backward peaks (bytes above the level when it
starts, by `runtime.peak.AllocationTracker`) and its forward + backward time. The step model
(`solver.step`) moves the timeline's head moments by the difference between the chosen way and
the model's own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..runtime.head import chunked_causal_lm_loss, chunked_head_problem
from ..runtime.peak import AllocationTracker
from ..runtime.timing import time_call
from ..runtime.trace import autocast_context, model_kwargs, train_mode
from ..schema import HeadCost


def _final_hidden(base: nn.Module, head: nn.Module, batch: Mapping[str, Any], amp: Any):
    """What `head` receives in a forward of `base` on `batch` (one forward without gradients)."""
    seen: list[torch.Tensor] = []
    handle = head.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad(), amp:
            base(**model_kwargs(base, {k: v for k, v in batch.items() if k != "labels"}))
    finally:
        handle.remove()
    return seen[-1]


def _losses(base: nn.Module, head: nn.Linear, labels: torch.Tensor) -> dict[str, Callable]:
    def full(x: torch.Tensor) -> torch.Tensor:
        return base.loss_function(head(x), labels, head.out_features)

    def chunked(x: torch.Tensor) -> torch.Tensor:
        return chunked_causal_lm_loss(head, x, labels)

    return {"full": full, "chunked": chunked}


def measure_heads(
    base: nn.Module,
    batch: Mapping[str, Any],
    autocast: torch.dtype | None = None,
    repeats: int = 3,
) -> dict[str, HeadCost]:
    """`HeadCost` per way of running `base`'s LM head and loss on `batch` (empty for a model that
    cannot take the chunked head, e.g. a seq2seq or masked LM, or a batch without labels)."""
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    labels = batch.get("labels")
    if chunked_head_problem(base) is not None or not isinstance(labels, torch.Tensor):
        return {}  # one way only (the model's own, in the timeline): nothing to choose
    assert isinstance(head, nn.Linear)
    device = head.weight.device
    params = [p for p in head.parameters() if p.requires_grad]
    out: dict[str, HeadCost] = {}
    with train_mode(base):
        hidden = _final_hidden(base, head, batch, autocast_context(device, autocast))
        for name, fn in _losses(base, head, labels).items():
            x = hidden.clone().requires_grad_()
            tracker = AllocationTracker(device)
            with tracker:
                with autocast_context(device, autocast):
                    loss = fn(x)
                tracker.mark("forward_end")
                grads = torch.autograd.grad(loss, [x, *params])
                del loss, grads

            def step(fn: Callable = fn, x: torch.Tensor = x) -> None:
                with autocast_context(device, autocast):
                    loss = fn(x)
                torch.autograd.grad(loss, [x, *params])

            out[name] = HeadCost(
                held=max(0, tracker.level("forward_end")),
                forward_peak=tracker.peak(None, "forward_end"),
                backward_peak=tracker.peak("forward_end", None),
                ms=time_call(step, device, repeats),
            )
    return out
