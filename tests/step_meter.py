"""Every training step's peak, measured by an independent meter (`runtime.capacity.DeviceMeter`):
the live storages of the whole run, profiling included, with no reading of the library's plans."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import TrainerCallback

from adacc_hf.runtime.capacity import DeviceMeter
from adacc_hf.runtime.peak import live_state_nbytes


class Predicted(TrainerCallback):
    """The step peak the plan of each optimizer step's bucket predicted (from `callback`'s
    session), beside `StepMeter`'s measurement."""

    def __init__(self, callback: TrainerCallback) -> None:
        self.callback = callback
        self.peaks: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        policy = self.callback.session.current.policy
        self.peaks.append(policy.metadata["predicted"]["peak_nbytes"])


class StepMeter(TrainerCallback):
    """Peak live bytes of each optimizer step of a Trainer run (``peaks[i]``: step i + 1), read
    from `meter`, which must be active around ``trainer.train()`` (see `metered`)."""

    def __init__(self, meter: DeviceMeter) -> None:
        self.meter = meter
        self.peaks: list[int] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.meter.reset_peak()

    def on_step_end(self, args, state, control, **kwargs):
        self.peaks.append(self.meter.peak_nbytes)


@contextlib.contextmanager
def metered(
    model: torch.nn.Module, capacity: int | None = None, inflate: float = 1.0
) -> Iterator[DeviceMeter]:
    """A `DeviceMeter` over the block, starting from the bytes `model` holds now."""
    with DeviceMeter(capacity, baseline=live_state_nbytes(model), inflate=inflate) as meter:
        yield meter


def train_metered(trainer, model, callback) -> tuple[list[int], list[int]]:
    """Train `trainer` with each optimizer step's peak metered (`StepMeter`) beside what its plan
    predicted (`Predicted`, from `callback`'s session, closed after); returns both lists."""
    with metered(model) as meter:
        steps, predicted = StepMeter(meter), Predicted(callback)
        trainer.add_callback(steps)
        trainer.add_callback(predicted)
        trainer.train()
    callback.session.close()
    return steps.peaks, predicted.peaks
