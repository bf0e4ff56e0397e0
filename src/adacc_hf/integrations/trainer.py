"""HF Trainer integration: `AdaccTrainingArguments`, the callback a plain `Trainer` picks up, and
`AdaccTrainer` (logs, artifacts in checkpoints, resume, model card and config metadata)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .. import __version__
from ..errors import AdaccError, PolicyError
from ..policy import Policy
from ..profiler import Profile
from .distributed import attach, sharding_from_trainer
from .session import AdaccConfig, AdaccSession

logger = logging.getLogger("adacc_hf")

POLICY_FILE = "adacc_policy.json"
PROFILE_FILE = "adacc_profile.json"
STATE_FILE = "adacc_state.json"
CALLBACK_NAME = "adacc"


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
    adacc_codecs: str | None = field(
        default=None,
        metadata=_help(
            "Comma-separated codecs the solver may use (default: each layer type's own codec). "
            "E.g. 'int4_outlier,int4_channel,int4_asym,bitpack'."
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
            "Seconds the MILP solver may take before falling back to full recomputation."
        ),
    )
    adacc_split_blocks: bool = field(
        default=True,
        metadata=_help(
            "Let blocks run different policies (some without checkpointing) to fill the budget."
        ),
    )

    def __post_init__(self) -> None:
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
        if CALLBACK_NAME not in self.report_to:
            self.report_to = [*self.report_to, CALLBACK_NAME]
        if self.ddp_find_unused_parameters is None:
            # Checkpointed blocks re-run in backward; DDP must not look for unused parameters.
            self.ddp_find_unused_parameters = False

    def adacc_config(self) -> AdaccConfig:
        codecs = None
        if self.adacc_codecs:
            codecs = [c.strip() for c in self.adacc_codecs.split(",") if c.strip()]
        mp = "bf16" if self.bf16 else "fp16" if self.fp16 else None
        return AdaccConfig(
            budget=self.adacc_memory_budget,
            codecs=codecs,
            zscore_threshold=self.adacc_zscore_threshold,
            adaptive=self.adacc_adaptive,
            max_tracking_interval=self.adacc_max_tracking_interval,
            solver=self.adacc_solver,
            solver_time_limit=self.adacc_solver_time_limit,
            max_codec_error=self.adacc_max_codec_error,
            split_blocks=self.adacc_split_blocks,
            optimizer=str(getattr(self.optim, "value", self.optim)),
            mixed_precision=mp,
            world_size=max(1, self.world_size),
        )


def write_artifacts(directory: str, session: AdaccSession) -> None:
    """Policy, profile and tracking state of `session` into `directory`."""
    os.makedirs(directory, exist_ok=True)
    if session.policy is not None:
        session.policy.save(os.path.join(directory, POLICY_FILE))
    if session.profile is not None:
        with open(os.path.join(directory, PROFILE_FILE), "w", encoding="utf-8") as f:
            f.write(session.profile.to_json() + "\n")
    with open(os.path.join(directory, STATE_FILE), "w", encoding="utf-8") as f:
        json.dump(session.state_dict(), f, indent=2, sort_keys=True)


def read_artifacts(directory: str) -> tuple[Policy | None, Profile | None, dict[str, Any]]:
    """What `write_artifacts` wrote (missing files give None / {})."""
    policy = profile = None
    state: dict[str, Any] = {}
    path = os.path.join(directory, POLICY_FILE)
    if os.path.exists(path):
        policy = Policy.load(path)
    path = os.path.join(directory, PROFILE_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            profile = Profile.from_json(f.read())
    path = os.path.join(directory, STATE_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    return policy, profile, state


class AdaccCallback(TrainerCallback):
    """Applies Adacc inside any `Trainer` whose args are `AdaccTrainingArguments(adacc=True)`."""

    def __init__(self) -> None:
        self.session: AdaccSession | None = None
        self.resume_dir: str | None = None  # set by AdaccTrainer on resume

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not getattr(args, "adacc", False) or model is None:
            return
        policy = profile = None
        sched: dict[str, Any] = {}
        if self.resume_dir is not None:
            policy, profile, st = read_artifacts(self.resume_dir)
            sched = st.get("schedule", {})
        if policy is None and args.adacc_policy:
            policy = Policy.load(args.adacc_policy)
        if self.session is not None:
            self.session.close()
        # Per-device budget: the static memory model divides sharded states by the world size.
        config = dataclasses.replace(args.adacc_config(), **sharding_from_trainer(args))
        self.session = AdaccSession(model, config, policy=policy, profile=profile)
        if sched:
            from ..evolution import TrackingSchedule

            self.session.schedule = TrackingSchedule.from_state_dict(sched)
        attach(self.session)  # distributed: rank 0's policy and switch decisions on every rank
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


def _register_callback() -> None:
    """Let `report_to=["adacc"]` (added by `AdaccTrainingArguments`) resolve to the callback."""
    from transformers.integrations import integration_utils

    integration_utils.INTEGRATION_TO_CALLBACK.setdefault(CALLBACK_NAME, AdaccCallback)


_register_callback()


def policy_card_summary(policy: Policy) -> dict[str, Any]:
    """The `adacc` entry written to model cards and config.json."""
    meta = policy.metadata
    return {
        "library": "adacc-hf",
        "library_version": __version__,
        "policy_fingerprint": policy.fingerprint(),
        "source": meta.get("source"),
        "budget": meta.get("budget_spec"),
        "budget_bytes": meta.get("budget_nbytes"),
        "predicted": meta.get("predicted"),
        "actions": policy.summary(),
        "per_op": {
            name: {
                f"variant{i}": {k: str(a) for k, a in sorted(v.actions.items())}
                if v.checkpoint
                else "no_checkpoint"
                for i, v in enumerate(g.variants)
            }
            for name, g in sorted(policy.groups.items())
        },
    }


class AdaccTrainer(Trainer):
    """`Trainer` with the whole Adacc experience: policy table and switches as log events,
    artifacts in every checkpoint, resume, and the policy in the model card and config.json."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, AdaccTrainingArguments):
            raise AdaccError("AdaccTrainer needs AdaccTrainingArguments")
        self._adacc_cb = next(
            (c for c in self.callback_handler.callbacks if isinstance(c, AdaccCallback)), None
        )
        if self._adacc_cb is None and self.args.adacc:
            self._adacc_cb = AdaccCallback()
            self.add_callback(self._adacc_cb)

    @property
    def adacc_session(self) -> AdaccSession | None:
        return self._adacc_cb.session if self._adacc_cb is not None else None

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        if self._adacc_cb is not None:
            path = resume_from_checkpoint
            if path is True:
                path = get_last_checkpoint(self.args.output_dir)
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
                logger.warning(
                    "adacc %s at step %d:\n%s",
                    event.kind,
                    event.step,
                    event.policy.table() if event.kind == "policy" else event.message,
                )
            self.log({"adacc/event_" + event.kind: 1.0, **event.metrics})

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        session = self.adacc_session
        model = self.accelerator.unwrap_model(self.model) if self.accelerator else self.model
        config = getattr(model, "config", None)
        if session is not None and session.policy is not None and config is not None:
            config.adacc = policy_card_summary(session.policy)
        super().save_model(output_dir, _internal_call)
        if session is not None and self.args.should_save:
            write_artifacts(output_dir or self.args.output_dir, session)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        super().create_model_card(*args, **kwargs)
        session = self.adacc_session
        if session is None or session.policy is None or not self.is_world_process_zero():
            return
        from huggingface_hub import ModelCard

        path = os.path.join(self.args.output_dir, "README.md")
        if not os.path.exists(path):
            return
        card = ModelCard.load(path)
        card.data.adacc = policy_card_summary(session.policy)
        card.save(path)
