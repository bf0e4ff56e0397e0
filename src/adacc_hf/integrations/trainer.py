"""HF Trainer integration: `AdaccCallback`, `AdaccTrainingArguments` and `AdaccTrainer`.

* ``Trainer(..., callbacks=[AdaccCallback(budget="20GiB")])`` works with any `TrainingArguments`
  (TRL's configs included): the callback reads the optimizer, mixed precision and sharding off the
  run's arguments.
* ``Trainer(args=AdaccTrainingArguments(adacc=True, adacc_memory_budget="20GiB"))``: the same,
  with the options on the command line (``--adacc --adacc_memory_budget 20GiB``).
* `AdaccTrainer` adds log events for the policy and its switches, resume, and the model card.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..adapters import unwrap_model
from ..errors import AdaccError, PolicyError
from ..policy import Policy
from .card import (
    POLICY_FILE,
    PROFILE_FILE,
    STATE_FILE,
    config_entry,
    read_artifacts,
    update_model_card,
    write_artifacts,
)
from .config import AdaccConfig
from .session import AdaccSession
from .sharding import sharding_from_trainer

logger = logging.getLogger("adacc_hf")

__all__ = [
    "POLICY_FILE",
    "PROFILE_FILE",
    "STATE_FILE",
    "AdaccCallback",
    "AdaccTrainer",
    "AdaccTrainingArguments",
    "run_config",
]

#: The `report_to` name under which `AdaccTrainingArguments(adacc=True)` reaches a plain Trainer.
INTEGRATION = "adacc"


#: Datasets up to this many rows are scanned for their longest ``input_ids`` (cheap: lengths only).
SCAN_ROWS = 100_000


def longest_sequence(args: Any, collator: Any = None, dataset: Any = None) -> int | None:
    """The run's longest batch length, where the run says it: TRL's ``max_length`` /
    ``max_seq_length``, a collator padding to ``max_length``, or the longest ``input_ids`` of a
    (pre-tokenised, not too large) training dataset. None when nothing says it (each new length
    is then planned when it first comes)."""
    for name in ("max_length", "max_seq_length"):
        n = getattr(args, name, None)
        if isinstance(n, int) and n > 0:
            return n
    n = getattr(collator, "max_length", None)
    if isinstance(n, int) and n > 0 and getattr(collator, "padding", None) == "max_length":
        return n
    try:
        if dataset is not None and 0 < len(dataset) <= SCAN_ROWS:
            names = getattr(dataset, "column_names", None)
            if names is not None and "input_ids" in names:
                return max(len(r) for r in dataset["input_ids"]) or None
    except Exception:  # an iterable or unusual dataset: nothing to read
        return None
    return None


def run_config(config: AdaccConfig, args: TrainingArguments) -> AdaccConfig:
    """`config` with what the run decides filled in from its arguments: the optimizer, mixed
    precision, world size and sharding (per-device budgets divide sharded states)."""
    mp = (
        "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else None
    )
    fields = {
        "optimizer": str(getattr(args.optim, "value", args.optim)),
        "mixed_precision": mp,
        "gradient_accumulation_steps": max(1, int(getattr(args, "gradient_accumulation_steps", 1))),
        "world_size": max(1, int(getattr(args, "world_size", 1) or 1)),
        **sharding_from_trainer(args),
    }
    return dataclasses.replace(config, **fields)


class AdaccCallback(TrainerCallback):
    """Applies Adacc inside any `Trainer`: profiles the first training batch, solves, patches the
    model, runs the rectifier on tracking steps, saves the policy with every checkpoint, restores it
    on resume and undoes everything when training ends.

    ``AdaccCallback(config)`` or ``AdaccCallback(budget="20GiB", ...)`` (any `AdaccConfig` field);
    ``policy`` reuses a saved policy (object or ``adacc_policy.json`` path). With neither, the
    options come from `AdaccTrainingArguments` when the run uses them.
    """

    def __init__(
        self,
        config: AdaccConfig | None = None,
        *,
        policy: Policy | str | None = None,
        **options: Any,
    ) -> None:
        if config is not None and options:
            raise AdaccError("give AdaccCallback either a config or options, not both")
        self.config = AdaccConfig(**options) if options else config
        self.policy = Policy.load(policy) if isinstance(policy, str) else policy
        self.session: AdaccSession | None = None
        self.resume_dir: str | None = None  # set by AdaccTrainer; else found from the state

    def _config(self, args: TrainingArguments) -> AdaccConfig:
        if self.config is not None:
            return self.config
        if isinstance(args, AdaccTrainingArguments):
            return args.adacc_config()
        return AdaccConfig()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        base = unwrap_model(model)
        owner = base.__dict__.get("_adacc_session")
        if owner is not None and owner is not self.session:
            logger.info("adacc: the model already has an adacc session; this callback stands by")
            return
        policy, profile, sched = self.policy, None, {}
        resume = self.resume_dir
        if resume is None and state.global_step > 0:  # resumed: the checkpoint it came from
            resume = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if resume is not None and os.path.isdir(resume):
            saved, profile, st = read_artifacts(resume)
            policy = saved or policy
            sched = st.get("schedule", {})
        if policy is None and isinstance(args, AdaccTrainingArguments) and args.adacc_policy:
            policy = Policy.load(args.adacc_policy)
        if self.session is not None:
            self.session.close()
        config = run_config(self._config(args), args)
        if config.max_seq_len is None:
            loader = kwargs.get("train_dataloader")
            collate = getattr(loader, "collate_fn", None)
            collate = getattr(collate, "data_collator", collate)  # Trainer's column remover
            longest = longest_sequence(args, collate, getattr(loader, "dataset", None))
            if longest is not None:
                config = dataclasses.replace(config, max_seq_len=longest)
        self.session = AdaccSession(
            model, config, policy=policy, profile=profile if policy else None
        )
        if sched:
            self.session.restore_schedule(sched)
        self.session.attach()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.session is not None:
            self.session.on_step_begin(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        if self.session is not None:
            self.session.on_step_end(state.global_step)

    def on_save(self, args, state, control, **kwargs):
        if self.session is not None and state.is_world_process_zero:
            ckpt = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            write_artifacts(ckpt, self.session)

    def on_train_end(self, args, state, control, **kwargs):
        if self.session is not None:
            if state.is_world_process_zero:
                write_artifacts(args.output_dir, self.session)
            self.session.close()


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass
class AdaccTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus Adacc's options. With ``adacc=True`` a plain `Trainer` profiles the
    first batch, solves the per-op policy for the budget and trains with it."""

    adacc: bool = field(
        default=False,
        metadata=_help(
            "Train with Adacc: per-op retain / compress / recompute of activations under a budget."
        ),
    )
    adacc_memory_budget: str = field(
        default="auto",
        metadata=_help(
            "Device memory budget per GPU: '20GiB', '20GB', '80%' of device memory, a byte count, "
            "or 'auto' (free memory minus max(1 GiB, 5%))."
        ),
    )
    adacc_policy: str | None = field(
        default=None,
        metadata=_help("A saved adacc_policy.json to reuse: skips profiling and solving."),
    )
    adacc_codecs: list[str] | None = field(
        default=None,
        metadata=_help(
            "Codecs the solver may use (default: each layer type's own codec), e.g. "
            "--adacc_codecs int4_outlier int4_channel int4_asym bitpack."
        ),
    )
    adacc_zscore_threshold: float = field(
        default=3.0,
        metadata=_help("Z-score above which a channel is an outlier kept exact by int4_outlier."),
    )
    adacc_adaptive: bool = field(
        default=True,
        metadata=_help(
            "Re-measure codec ratios and errors during training (1, 2, 4, ... steps apart) and "
            "switch policy when the optimum changes."
        ),
    )
    adacc_max_tracking_interval: int = field(
        default=1024, metadata=_help("Largest number of steps between two tracking steps.")
    )
    adacc_max_codec_error: float = field(
        default=0.5,
        metadata=_help(
            "A codec whose relative error on an op exceeds this is not used for that op."
        ),
    )
    adacc_solver: str = field(default="cbc", metadata=_help("MILP solver: 'cbc' or 'highs'."))
    adacc_solver_time_limit: float = field(
        default=10.0,
        metadata=_help(
            "Seconds the MILP solver may search; then its best policy so far is used (with a "
            "warning). If it has none, or the solver fails, full recomputation is used."
        ),
    )
    adacc_split_blocks: bool = field(
        default=True,
        metadata=_help(
            "Let blocks run different policies (some without checkpointing) to fill the budget."
        ),
    )
    adacc_max_seq_len: int | None = field(
        default=None,
        metadata=_help(
            "The longest sequence of the run. Its bucket is planned before the first step, so a "
            "budget too small for it fails at once (default: each bucket is planned when its "
            "first batch comes)."
        ),
    )

    def __post_init__(self) -> None:
        if self.adacc_codecs is not None:  # also "a,b" (a YAML string, older command lines)
            items = [self.adacc_codecs] if isinstance(self.adacc_codecs, str) else self.adacc_codecs
            self.adacc_codecs = [c.strip() for i in items for c in str(i).split(",") if c.strip()]
        super().__post_init__()
        if not self.adacc:
            return
        if getattr(self, "activation_checkpointing", False) or getattr(
            self, "gradient_checkpointing", False
        ):
            raise AdaccError(
                "adacc replaces activation checkpointing: drop --gradient_checkpointing / "
                "--activation_checkpointing (or set adacc=False)"
            )
        if getattr(self, "torch_compile", False):
            raise AdaccError(
                "adacc does not run under torch.compile yet (its per-op runtime is a pair of "
                "Python dispatch modes dynamo cannot trace): drop --torch_compile (or set "
                "adacc=False); see docs/compile.md"
            )
        fsdp_config = getattr(self, "fsdp_config", None) or {}
        if fsdp_config.get("activation_checkpointing"):
            raise AdaccError(
                "fsdp_config['activation_checkpointing'] (FSDP's own checkpointing) cannot be "
                "combined with adacc: remove it from fsdp_config"
            )
        from ..solver import parse_budget

        try:
            parse_budget(self.adacc_memory_budget, "cpu")  # syntax check before any work
        except Exception as e:
            raise AdaccError(f"adacc_memory_budget: {e}") from None
        if self.adacc_policy is not None:
            try:
                Policy.load(self.adacc_policy)
            except PolicyError as e:
                raise AdaccError(f"adacc_policy: {e}") from None
        self.adacc_config()  # validates codecs and intervals
        if self.ddp_find_unused_parameters is None:
            # Checkpointed blocks re-run in backward; DDP must not look for unused parameters.
            self.ddp_find_unused_parameters = False
        _enable_integration(self)

    def adacc_config(self) -> AdaccConfig:
        """The `AdaccConfig` these options describe (run-dependent fields: see `run_config`)."""
        return AdaccConfig(
            budget=self.adacc_memory_budget,
            codecs=list(self.adacc_codecs) if self.adacc_codecs else None,
            zscore_threshold=self.adacc_zscore_threshold,
            adaptive=self.adacc_adaptive,
            max_tracking_interval=self.adacc_max_tracking_interval,
            solver=self.adacc_solver,
            solver_time_limit=self.adacc_solver_time_limit,
            max_codec_error=self.adacc_max_codec_error,
            split_blocks=self.adacc_split_blocks,
            max_seq_len=self.adacc_max_seq_len,
        )

    # The integration name is in `report_to` only while the object lives in this process: what
    # is logged, JSON-serialised or pickled (`training_args.bin`) shows the user's `report_to`.
    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if isinstance(d.get("report_to"), list):
            d["report_to"] = [r for r in d["report_to"] if r != INTEGRATION]
        return d

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if isinstance(state.get("report_to"), list):
            state["report_to"] = [r for r in state["report_to"] if r != INTEGRATION]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if getattr(self, "adacc", False):
            _enable_integration(self)


def _enable_integration(args: AdaccTrainingArguments) -> None:
    """Let a plain `Trainer` built with these arguments add `AdaccCallback` itself.

    A `Trainer` builds its callbacks from ``report_to`` names only, so adacc joins those names
    (registered when the first adacc-enabled arguments are created, never at import)."""
    from transformers.integrations import integration_utils

    integration_utils.INTEGRATION_TO_CALLBACK.setdefault(INTEGRATION, AdaccCallback)
    if INTEGRATION not in args.report_to:
        args.report_to = [*args.report_to, INTEGRATION]


class AdaccTrainer(Trainer):
    """`Trainer` with the whole Adacc experience: the policy table and every switch as log events,
    artifacts in every checkpoint, resume, and the policy in the model card and ``config.json``."""

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

    @property
    def adacc_session(self) -> AdaccSession | None:
        return self._adacc_cb.session if self._adacc_cb is not None else None

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        path = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)
        if self._adacc_cb is not None:
            self._adacc_cb.resume_dir = path if isinstance(path, str) else None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any):
        loss = super().training_step(*args, **kwargs)
        self._log_adacc_events()
        return loss

    def _log_adacc_events(self) -> None:
        session = self.adacc_session
        if session is None:
            return
        for event in session.drain_events():
            if event.kind == "track":
                continue
            if event.policy is not None and self.is_world_process_zero():
                logger.info(
                    "adacc %s at step %d:\n%s",
                    event.kind,
                    event.step,
                    event.policy.table() if event.kind == "policy" else event.message,
                )
            self.log({"adacc/event_" + event.kind: 1.0, **event.metrics})

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        session = self.adacc_session
        policy = session.policy if session is not None else None
        model = self.accelerator.unwrap_model(self.model) if self.accelerator else self.model
        with config_entry(getattr(model, "config", None), policy):
            super().save_model(output_dir, _internal_call)
        if session is not None and self.args.should_save:
            write_artifacts(output_dir or self.args.output_dir, session)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        super().create_model_card(*args, **kwargs)
        session = self.adacc_session
        if session is None or session.policy is None or not self.is_world_process_zero():
            return
        update_model_card(self.args.output_dir, session.policy)
