"""`AdaccTrainingArguments`: `TrainingArguments` plus Adacc's options (``--adacc ...``)."""

from __future__ import annotations

import dataclasses
import logging
import textwrap
import warnings
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..engine.config import AdaccConfig
from ..engine.options import GROUPS, OPTION_GROUP, option_help
from ..errors import AdaccError, PolicyError
from ..policy import Policy
from .callback import AdaccCallback
from .run_facts import (
    checkpointing_by_default,
    checkpointing_on,
    checkpointing_typed,
    explicit_checkpointing_error,
    switch_off_own_checkpointing,
)

__all__ = ["INTEGRATION", "AdaccTrainingArguments"]

logger = logging.getLogger("adacc_hf")

#: The `report_to` name under which `AdaccTrainingArguments(adacc=True)` reaches a plain Trainer.
INTEGRATION = "adacc"
#: Old option names (one release): each is ``adacc_`` + its option's name now.
RENAMED = {"adacc_memory_budget": "adacc_budget", "adacc_profile": "adacc_profile_from"}


def _help(text: str) -> dict[str, str]:
    return {"help": text}


def _flag(name: str) -> Any:
    """The ``adacc_<name>`` field of option `name`: its group's default, and its group's text
    (`option_help`) as its ``--help``."""
    group = GROUPS[OPTION_GROUP[name]]
    default = next(f.default for f in dataclasses.fields(group) if f.name == name)
    return field(default=default, metadata=_help(option_help(name)))


@dataclass
class AdaccTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus Adacc's options (``--adacc ...`` on the command line).

    With ``adacc=True`` a plain `Trainer` profiles the first batch, solves the per-op policy for
    the budget and trains with it (`AdaccCallback`, added through ``report_to``, which wires the
    rest into the Trainer: `wiring`). Every option is ``adacc_`` + its name (the field of its
    group: `MemoryOptions`, `CodecOptions`, `OffloadOptions`, `SolverOptions`,
    `TrackingOptions`), with its group's text as ``--help``; ``compile`` comes from
    ``--torch_compile``. They become an `AdaccConfig` (`adacc_config`); the facts of the run
    from the other arguments (`RunFacts.from_training_args`). Without ``adacc=True`` they are
    ignored (with a warning). With it, Adacc replaces activation checkpointing: checkpointing
    that the arguments' class turns on by default (TRL's configs) is switched off, and
    ``ddp_find_unused_parameters`` defaults to False.

    Attributes:
        adacc: train with Adacc: per-op retain / compress / recompute of activations under a
            budget.
        adacc_budget: device memory budget per GPU: ``"20GiB"``, ``"20GB"``, ``"80%"`` of
            device memory, a byte count, or ``"auto"`` (free memory plus what the model already
            holds, minus max(1 GiB, 5%)).
        adacc_policy: a saved ``adacc_policy.json`` to reuse: skips profiling and solving.
        adacc_memory_budget: deprecated name of ``adacc_budget`` (one release, with a warning).
        adacc_profile: deprecated name of ``adacc_profile_from`` (one release, with a warning).
        adacc_<name>: each option's flag (its entries: `_flags_doc`).

    Raises:
        AdaccError: with ``adacc=True``: an option Adacc cannot take (a malformed budget, a
            policy file that does not load, an unknown codec, ...), or activation checkpointing
            the user turned on (``--gradient_checkpointing``, checkpointing kwargs,
            ``fsdp_config["activation_checkpointing"]``), which Adacc replaces.
    """

    adacc: bool = field(
        default=False,
        metadata=_help(
            "Train with Adacc: per-op retain / compress / recompute of activations under a budget."
        ),
    )
    adacc_budget: str = field(
        default="auto",
        metadata=_help(
            "Device memory budget per GPU: '20GiB', '20GB', '80%' of device memory, a byte count, "
            "or 'auto' (free memory plus what the model already holds, minus max(1 GiB, 5%))."
        ),
    )
    adacc_policy: str | None = field(
        default=None,
        metadata=_help("A saved adacc_policy.json to reuse: skips profiling and solving."),
    )
    # MemoryOptions
    adacc_headroom: float | None = _flag("headroom")
    adacc_allocator: str = _flag("allocator")
    adacc_expandable_segments: bool = _flag("expandable_segments")
    adacc_max_seq_len: int | None = _flag("max_seq_len")
    adacc_auto_batch_size: bool = _flag("auto_batch_size")
    # CodecOptions (`_flag` returns a `field`, default None)
    adacc_codecs: list[str] | None = _flag("codecs")  # noqa: RUF009
    adacc_codec_backends: list[str] | None = _flag("codec_backends")  # noqa: RUF009
    adacc_zscore_threshold: float = _flag("zscore_threshold")
    adacc_max_codec_error: float = _flag("max_codec_error")
    adacc_max_grad_error: float | None = _flag("max_grad_error")
    # OffloadOptions
    adacc_offload: bool | None = _flag("offload")
    adacc_offload_host_cap: str | None = _flag("offload_host_cap")
    # SolverOptions
    adacc_solver: str = _flag("solver")
    adacc_solver_time_limit: float = _flag("solver_time_limit")
    adacc_split_blocks: bool = _flag("split_blocks")
    adacc_head: str = _flag("head")
    adacc_profile_repeats: int = _flag("profile_repeats")
    # TrackingOptions
    adacc_adaptive: bool = _flag("adaptive")
    adacc_max_tracking_interval: int = _flag("max_tracking_interval")
    adacc_profile_from: str | None = _flag("profile_from")
    # old names, kept for one release (`RENAMED`)
    adacc_memory_budget: str | None = field(
        default=None, metadata=_help("Deprecated: --adacc_budget.")
    )
    adacc_profile: str | None = field(
        default=None, metadata=_help("Deprecated: --adacc_profile_from.")
    )

    def _take_renamed(self) -> None:
        """Old option names fill the new ones, with a warning (both given: an error)."""
        for old, new in RENAMED.items():
            value = getattr(self, old)
            if value is None:
                continue
            default = next(f.default for f in dataclasses.fields(self) if f.name == new)
            if getattr(self, new) not in (default, value):
                raise AdaccError(f"{old} is the old name of {new}: give only {new}")
            warnings.warn(
                f"{old} is renamed {new} (the option's name); the old name goes in "
                "the next release",
                FutureWarning,
                stacklevel=4,
            )
            setattr(self, new, value)
            setattr(self, old, None)

    def __post_init__(self) -> None:
        self._take_renamed()
        if self.adacc_codecs is not None:  # also "a,b" (a YAML string, older command lines)
            items = [self.adacc_codecs] if isinstance(self.adacc_codecs, str) else self.adacc_codecs
            self.adacc_codecs = [c.strip() for i in items for c in str(i).split(",") if c.strip()]
        typed = checkpointing_typed(self)  # before the parent resolves the two names
        super().__post_init__()
        if not self.adacc:
            given = [
                f.name
                for f in dataclasses.fields(self)
                if f.name.startswith("adacc_") and getattr(self, f.name) != f.default
            ]
            if given:
                logger.warning(
                    "adacc options given without adacc=True (%s): Adacc is off for this run; "
                    "add --adacc (adacc=True) to use them",
                    ", ".join(given),
                )
            return
        if checkpointing_on(self):
            if typed:
                raise AdaccError(
                    "adacc replaces activation checkpointing: drop --gradient_checkpointing / "
                    "--activation_checkpointing (or set adacc=False)"
                )
            if not checkpointing_by_default(self):  # checkpointing kwargs set by the user
                raise explicit_checkpointing_error(self)
            switch_off_own_checkpointing(self)
            logger.info(
                "adacc takes over activation checkpointing: %s turns gradient_checkpointing on "
                "by default, so the run's own is switched off and adacc's per-op policy "
                "replaces it",
                type(self).__name__,
            )
        fsdp_config = getattr(self, "fsdp_config", None) or {}
        if fsdp_config.get("activation_checkpointing"):
            raise AdaccError(
                "fsdp_config['activation_checkpointing'] (FSDP's own checkpointing) cannot be "
                "combined with adacc: remove it from fsdp_config"
            )
        from ..solver import parse_budget

        try:
            parse_budget(self.adacc_budget, "cpu")  # syntax check before any work
        except Exception as e:
            raise AdaccError(f"adacc_budget: {e}") from None
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
        """The `AdaccConfig` these options describe (the facts of the run: `run_config`).

        Returns:
            The config: each ``adacc_<name>`` as the option ``<name>``, ``compile`` from
            ``--torch_compile`` (and ``--torch_compile_backend``).
        """
        options: dict[str, Any] = {
            n: getattr(self, f"adacc_{n}") for n in OPTION_GROUP if n != "compile"
        }
        grad = self.adacc_max_grad_error
        options.update(
            codecs=list(self.adacc_codecs) if self.adacc_codecs else None,
            codec_backends=list(self.adacc_codec_backends) if self.adacc_codec_backends else None,
            max_grad_error=None if grad is None or grad < 0 else grad,  # negative: no bound
            # --torch_compile: the Trainer compiles the model whole (Accelerate), adacc profiles
            # its blocks and head compiled with the same backend and plans without offload
            compile=(getattr(self, "torch_compile_backend", None) or "inductor")
            if getattr(self, "torch_compile", False)
            else None,
        )
        return AdaccConfig(self.adacc_budget, **options)

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


def _flags_doc(doc: str) -> str:
    """`doc` with an ``Attributes:`` entry per option flag (its ``--help``) for ``adacc_<name>``."""
    lines = []
    for f in dataclasses.fields(AdaccTrainingArguments):
        if f.name.startswith("adacc_") and f.name[len("adacc_") :] in OPTION_GROUP:
            text = textwrap.fill(f"{f.name}: {f.metadata['help']}", 88, subsequent_indent="    ")
            lines += [f"        {line}" for line in text.splitlines()]
    return doc.replace(
        "        adacc_<name>: each option's flag (its entries: `_flags_doc`).", "\n".join(lines)
    )


AdaccTrainingArguments.__doc__ = _flags_doc(AdaccTrainingArguments.__doc__ or "")
