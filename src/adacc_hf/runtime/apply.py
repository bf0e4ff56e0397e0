"""`apply_adacc`: patch a model instance so every block runs its policy; `remove()` undoes it."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..adapters import get_adapter, unwrap_model
from ..errors import AdaccError, AlreadyAppliedError
from ..policy import Policy
from .checkpoint import BlockRuntime

_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")
_HANDLE_ATTR = "_adacc_handle"


class AdaccHandle:
    """What `apply_adacc` did to one model; `remove()` (or leaving the `with` block) restores it."""

    def __init__(self, model: nn.Module, policy: Policy) -> None:
        self.model = model
        self.policy = policy
        self.runtimes: dict[str, BlockRuntime] = {}
        self._saved: list[tuple[nn.Module, dict[str, Any]]] = []
        self.active = False

    def _install(self) -> None:
        adapter = get_adapter(self.model)
        warned: set = set()
        for group in adapter.block_groups(self.model):
            gp = self.policy.groups[group.name]
            known = {o.key for o in gp.ops}
            for path, block, variant in zip(
                group.paths, group.modules, gp.block_variants(), strict=True
            ):
                if not variant.checkpoint:
                    continue  # no checkpoint machinery at all: zero overhead
                self._saved.append(
                    (block, {a: block.__dict__[a] for a in _ATTRS if a in block.__dict__})
                )
                rt = BlockRuntime(block, path, group.name, variant, known, warned)
                self.runtimes[path] = rt
                block.gradient_checkpointing = True
                block._gradient_checkpointing_func = rt
        setattr(self.model, _HANDLE_ATTR, self)
        self.active = True

    def remove(self) -> None:
        """Restore the model exactly as it was before `apply_adacc`. Safe to call twice."""
        if not self.active:
            return
        for rt in self.runtimes.values():
            rt.remove()
        for block, attrs in self._saved:
            for a in _ATTRS:
                if a in attrs:
                    setattr(block, a, attrs[a])
                else:
                    block.__dict__.pop(a, None)
        self._saved.clear()
        self.runtimes.clear()
        self.model.__dict__.pop(_HANDLE_ATTR, None)
        self.active = False

    def set_policy(self, policy: Policy) -> None:
        """Switch to another policy for the same model (between training steps)."""
        policy.validate(self.model)
        self.remove()
        self.policy = policy
        self._install()

    def set_tracker(self, tracker: Any) -> None:
        """Hand every checkpointed block's ops to `tracker` during the next forwards (None: stop)."""
        for rt in self.runtimes.values():
            rt.tracker = tracker

    def cached_bytes(self) -> dict[str, int]:
        """Bytes each checkpointed block cached (raw or encoded) in its last forward."""
        return {p: sum(rt.last_bytes.values()) for p, rt in self.runtimes.items()}

    @property
    def unknown_ops(self) -> set[str]:
        """Ops seen at run time that the policy does not name (they were recomputed)."""
        return set().union(*(rt.unknown for rt in self.runtimes.values()))

    @property
    def fallbacks(self) -> set[str]:
        """Compressed ops whose values a codec could not encode (kept exact instead)."""
        return set().union(*(rt.fallbacks for rt in self.runtimes.values()))

    def __enter__(self) -> AdaccHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _gradient_checkpointing_layer() -> type:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError as e:  # pragma: no cover - transformers < 4.52
        raise AdaccError(
            "adacc-hf needs transformers' GradientCheckpointingLayer (transformers >= 4.56)"
        ) from e
    return GradientCheckpointingLayer


def apply_adacc(model: nn.Module, policy: Policy) -> AdaccHandle:
    """Make every transformer block of `model` run `policy`. Returns a handle to undo it.

    Works on plain transformers models and on PEFT-wrapped ones; patches only this instance.
    """
    base = unwrap_model(model)
    existing = base.__dict__.get(_HANDLE_ATTR)
    if existing is not None and existing.active:
        raise AlreadyAppliedError(
            "adacc is already applied to this model: call handle.remove() first, or "
            "handle.set_policy(new_policy) to switch policies"
        )
    policy.validate(base)
    gcl = _gradient_checkpointing_layer()
    for group in get_adapter(base).block_groups(base):
        for path, block in zip(group.paths, group.modules, strict=True):
            if not isinstance(block, gcl):
                raise AdaccError(
                    f"block {path} ({type(block).__name__}) is not a "
                    "GradientCheckpointingLayer; upgrade transformers"
                )
            if block.gradient_checkpointing:
                raise AdaccError(
                    "transformers' gradient checkpointing is enabled on this model; adacc replaces "
                    "it. Call model.activation_checkpointing_disable() (gradient_checkpointing_"
                    "disable() before transformers 5.23) and leave TrainingArguments."
                    "gradient_checkpointing off before applying adacc"
                )
    handle = AdaccHandle(base, policy)
    handle._install()
    return handle
