"""Out of memory in a step is survived: the step's micro-batches run again under a smaller plan.

One rule for every entry point (`AdaccTrainer`, a plain `Trainer` with `AdaccCallback` or
`AdaccTrainingArguments`, TRL's trainers, and custom loops through `AdaccSession.run_step`): when
a micro-batch raises ``torch.OutOfMemoryError``, what it left is freed, the session grows the
reserve every plan keeps free (`oom.grown_reserve`; every bucket is planned again before its next
forward), the gradients are emptied, and the optimizer step's micro-batches run again from the
first, each with the random state it first ran with: the gradients are exactly those of a run
that never failed, and no batch is skipped. Where that cannot hold, the error is raised with what
to change: the gradients were not empty when the optimizer step began (nothing could restore
them), or the reserve already leaves only full recomputation (the step does not fit the device).

Retries need one process whose gradients live in the parameters: under DDP / DeepSpeed / FSDP
another rank would wait in a collective forever, so there the error is raised as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .oom import release

__all__ = ["StepRetry"]

logger = logging.getLogger("adacc_hf")

RngState = tuple[torch.Tensor, torch.Tensor | None]


def rng_state(device: torch.device) -> RngState:
    """The random states a micro-batch starts from (the host's, and the device's on CUDA)."""
    cuda = device.type == "cuda"
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None


def set_rng_state(state: RngState, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


@dataclass
class _Window:
    """The micro-batches of one optimizer step run so far (arguments and random state);
    `clean`: the gradients were empty when it began."""

    key: Any
    clean: bool
    done: list[tuple[tuple[Any, ...], RngState]] = field(default_factory=list)


class StepRetry:
    """Runs micro-batches so that one which runs out of memory is re-planned and re-run.

    Args:
        session: returns the planning session (None: nothing to re-plan, errors pass through).
        model: the module whose parameters hold the gradients.
        device: the device the step runs on.
        on_retry: called after each recovery (an entry point logs the session's events there).
    """

    def __init__(
        self,
        session: Callable[[], Any],
        model: torch.nn.Module,
        device: torch.device,
        on_retry: Callable[[], None] | None = None,
    ) -> None:
        self.session, self.model, self.device = session, model, torch.device(device)
        self.on_retry = on_retry
        self.retries = 0
        self._window: _Window | None = None

    def micro_batch(self, key: Any, run: Callable[..., Any], *args: Any) -> Any:
        """Run ``run(*args)``, one micro-batch of the optimizer step `key` (a new key starts a
        new step); after an out-of-memory error the step's micro-batches so far run again."""
        window = self._window
        if window is None or window.key != key:
            clean = all(p.grad is None for p in self.model.parameters())
            window = self._window = _Window(key, clean)
        todo = [(args, rng_state(self.device))]
        retry = False
        while True:
            message = None
            try:
                for a, rng in todo:
                    if retry:
                        set_rng_state(rng, self.device)
                    out = run(*a)
            except torch.OutOfMemoryError as e:
                message = str(e)  # leaving this block frees the failed step's tensors
            if message is None:
                break
            self._recover(message, window)
            todo, retry = [*window.done, todo[-1]], True
        window.done.append(todo[-1])
        return out

    def whole_step(self, run: Callable[[Any], Any], batches: Iterable[Any]) -> list[Any]:
        """Run ``run(batch)`` for every micro-batch of one optimizer step; returns their results
        (a micro-batch run again gives what it gave the first time: same inputs, same random
        state, gradients emptied)."""
        key = object()  # a new optimizer step
        try:
            return [self.micro_batch(key, run, batch) for batch in batches]
        finally:
            self._window = None  # the step is over: hold none of its batches until the next

    def _recover(self, message: str, window: _Window) -> None:
        release(self.device)
        session = self.session()
        if session is None:
            raise torch.OutOfMemoryError(message)
        if not window.clean:
            raise torch.OutOfMemoryError(
                f"{message}\nadacc: not retried: the gradients were not empty when this "
                "optimizer step began, so a re-run could not restore them"
            )
        if not session.out_of_memory(message):
            raise torch.OutOfMemoryError(
                f"{message}\nadacc: even full recomputation does not fit the device: lower the "
                "micro-batch (per_device_train_batch_size; raise gradient_accumulation_steps to "
                "keep the global batch) or the sequence length, or set the budget below what "
                "the device has free"
            )
        for p in self.model.parameters():
            p.grad = None
        self.retries += 1
        logger.warning(
            "adacc: out of memory in a step; re-planned with %.1f MiB kept free and running the "
            "step's %d micro-batch(es) again",
            session.oom_reserve_nbytes / 2**20,
            len(window.done) + 1,
        )
        if self.on_retry is not None:
            self.on_retry()
