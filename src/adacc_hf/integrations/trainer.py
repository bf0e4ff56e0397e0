"""HF Trainer integration: `AdaccCallback`, `AdaccTrainingArguments` and `AdaccTrainer`.

* ``Trainer(..., callbacks=[AdaccCallback(budget="20GiB")])`` works with any `TrainingArguments`
  (TRL's configs included): the callback reads the optimizer, mixed precision and sharding off the
  run's arguments.
* ``Trainer(args=AdaccTrainingArguments(adacc=True, adacc_budget="20GiB"))``: the same,
  with the options on the command line (``--adacc --adacc_budget 20GiB``).
* `AdaccTrainer`: a `Trainer` that insists on adacc being configured. Every feature (automatic
  micro-batch, out-of-memory retry, events as metrics, artifacts, resume, the model card) is wired
  into any Trainer by the callback (`wiring`), so the three are the same run.
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer

from ..engine.session import AdaccSession
from ..errors import AdaccError
from .arguments import AdaccTrainingArguments
from .callback import AdaccCallback
from .card import POLICY_FILE, PROFILE_FILE, STATE_FILE
from .run_facts import longest_sequence, run_config
from .wiring import attach

__all__ = [
    "POLICY_FILE",
    "PROFILE_FILE",
    "STATE_FILE",
    "AdaccCallback",
    "AdaccTrainer",
    "AdaccTrainingArguments",
    "longest_sequence",
    "run_config",
]


class AdaccTrainer(Trainer):
    """A `Trainer` that refuses to run without adacc configured, and names its session.

    It trains exactly as a plain `Trainer` with `AdaccTrainingArguments` (``adacc=True``) or an
    `AdaccCallback` in ``callbacks`` does (the callback wires every feature into any Trainer:
    `wiring`); the session is ``trainer.adacc_session`` once training starts.

    Args:
        *args: `Trainer`'s positional arguments (``model``, ``args``, ...).
        **kwargs: `Trainer`'s keyword arguments (``callbacks=[AdaccCallback(...)]`` among them).

    Raises:
        AdaccError: neither `AdaccTrainingArguments` nor an `AdaccCallback` given.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._adacc_cb = next(
            (c for c in self.callback_handler.callbacks if isinstance(c, AdaccCallback)), None
        )
        if self._adacc_cb is None:
            if not isinstance(self.args, AdaccTrainingArguments):
                raise AdaccError(
                    "AdaccTrainer needs AdaccTrainingArguments or callbacks=[AdaccCallback(...)]"
                )
            if self.args.adacc:
                self._adacc_cb = AdaccCallback()
                self.add_callback(self._adacc_cb)
        if self._adacc_cb is not None:
            attach(self, self._adacc_cb)

    @property
    def adacc_session(self) -> AdaccSession | None:
        """The run's `AdaccSession` (None before training starts, or without adacc)."""
        return self._adacc_cb.session if self._adacc_cb is not None else None
