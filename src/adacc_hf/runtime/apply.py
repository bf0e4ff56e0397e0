"""`apply_adacc`: patch a model instance so every block runs its policy; `remove()` undoes it."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..adapters import get_adapter, unwrap_model
from ..adapters.forward import hook_forward, unhook_forward
from ..errors import AdaccError, AlreadyAppliedError
from ..policy import Policy
from . import saved_codecs
from .checkpoint import BlockRuntime
from .head import HeadPatch
from .offload import HostStore

_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")
_HANDLE_ATTR = "_adacc_handle"


class AdaccHandle:
    """What `apply_adacc` did to one model; `remove()` (or leaving the `with` block) restores it.

    Made by `apply_adacc`, which installs it; `set_policy` switches policies between steps.

    Args:
        model: the unwrapped model it patches.
        policy: the policy it runs.
        host_cap: the most bytes of host memory offloaded tensors may hold (None: the default,
            `runtime.offload`).
    """

    def __init__(self, model: nn.Module, policy: Policy, host_cap: int | None = None) -> None:
        self.model = model
        self.policy = policy
        self.host_cap = host_cap
        self.host: HostStore | None = None  # made once a policy offloads anything
        self.runtimes: dict[str, BlockRuntime] = {}
        self._saved: list[tuple[nn.Module, dict[str, Any]]] = []
        self.head: HeadPatch | None = None  # the chunked LM head, when the policy asks for it
        self.codec_hooks = False  # `saved_codecs` pushed for this handle
        self.active = False

    def _install(self) -> None:
        adapter = get_adapter(self.model)
        warned: set = set()
        compiled = bool(self.policy.metadata.get("compile"))
        for group in adapter.block_groups(self.model):
            gp = self.policy.groups[group.name]
            for path, block, variant in zip(
                group.paths, group.modules, gp.block_variants(), strict=True
            ):
                if not variant.checkpoint:
                    continue  # no checkpoint machinery at all: zero overhead
                self._saved.append(
                    (block, {a: block.__dict__[a] for a in _ATTRS if a in block.__dict__})
                )
                rt = BlockRuntime(block, path, group.name, gp, variant, warned, compiled)
                rt.root = self.model
                self.runtimes[path] = rt
                hook_forward(block)  # a plain block: reached as transformers' layers are
                block.gradient_checkpointing = True
                block._gradient_checkpointing_func = rt
        self._set_head(self.policy.head)
        self._set_host(self.policy)
        self._set_codec_hooks(self.policy)
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
            unhook_forward(block)
        self._saved.clear()
        self.runtimes.clear()
        self._set_head("full")
        self._set_codec_hooks(None)
        self.model.__dict__.pop(_HANDLE_ATTR, None)
        self.active = False

    def set_policy(self, policy: Policy) -> None:
        """Switch to another policy for the same model (between training steps).

        When the same blocks are checkpointed, the block runtimes stay and keep their slot tables
        per variant (switching back and forth, e.g. between per-shape plans, rebuilds nothing).

        Args:
            policy: a policy made for this model.

        Raises:
            PolicyError: `policy` was not made for this model's family and structure.
        """
        policy.validate(self.model)
        adapter = get_adapter(self.model)
        plan = []
        for group in adapter.block_groups(self.model):
            gp = policy.groups[group.name]
            for path, variant in zip(group.paths, gp.block_variants(), strict=True):
                plan.append((path, gp, variant))
        if self.active and {p for p, _, v in plan if v.checkpoint} == set(self.runtimes):
            for path, gp, variant in plan:
                if variant.checkpoint:
                    rt = self.runtimes[path]
                    rt.planned_for_compile = bool(policy.metadata.get("compile"))
                    rt.set_variant(variant, gp)
            self._set_head(policy.head)
            self._set_host(policy)
            self._set_codec_hooks(policy)
            self.policy = policy
            return
        self.remove()
        self.policy = policy
        self._install()

    def _set_host(self, policy: Policy) -> None:
        """The host store offloading blocks park their tensors in (one per model, kept across
        policy switches so its buffers are reused)."""
        if self.host is None and policy.offloads:
            param = next(self.model.parameters(), None)
            device = param.device if param is not None else "cpu"
            self.host = HostStore(device, self.host_cap)
        for rt in self.runtimes.values():
            rt.host = self.host

    def _set_codec_hooks(self, policy: Policy | None) -> None:
        """Install `saved_codecs`' hooks while a policy planned for compile compresses (compiled
        graphs encode its outputs through them), remove them otherwise."""
        need = (
            policy is not None
            and bool(policy.metadata.get("compile"))
            and any(
                a.kind == "compress"
                for gp in policy.groups.values()
                for v in gp.variants
                for a in v.actions.values()
            )
        )
        if need and not self.codec_hooks:
            saved_codecs.push()
        elif self.codec_hooks and not need:
            saved_codecs.pop()
        self.codec_hooks = need

    def _set_head(self, head: str) -> None:
        """Install or remove the chunked LM head (`runtime.head`) to match `head`."""
        if head == "chunked" and self.head is None:
            self.head = HeadPatch(self.model)
        elif head != "chunked" and self.head is not None:
            self.head.remove()
            self.head = None

    def set_tracker(self, tracker: Any) -> None:
        """Hand every checkpointed block's ops to `tracker` during the next forwards (None: stop)."""
        for rt in self.runtimes.values():
            rt.tracker = tracker

    def cached_bytes(self) -> dict[str, int]:
        """Bytes each checkpointed block cached (raw or encoded) in its last forward."""
        return {p: rt.last_nbytes for p, rt in self.runtimes.items()}

    @property
    def unknown_ops(self) -> set[str]:
        """Ops seen at run time that the policy does not describe (another key, op overload,
        dtype or rank in their region): they were recomputed."""
        return set().union(*(rt.unknown for rt in self.runtimes.values()))

    @property
    def problems(self) -> list[str]:
        """Every mismatch between policy and model the runtime met (also logged once each)."""
        return [p for rt in self.runtimes.values() for p in rt.problems]

    @property
    def fallbacks(self) -> set[str]:
        """Always empty: codecs encode inf / NaN in place at the planned size (kept for
        compatibility; ops used to fall back to an exact copy)."""
        return set()

    def __enter__(self) -> AdaccHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def apply_adacc(model: nn.Module, policy: Policy, host_cap: int | None = None) -> AdaccHandle:
    """Make every transformer block of `model` run `policy`. Returns a handle to undo it.

    Works on transformers models, PEFT-wrapped ones and plain PyTorch models whose blocks were
    named (`adapters.plain.register`, ``prepare(..., blocks=...)``: their blocks' forward is
    hooked while the policy is applied); patches only this instance.
    A model compiled with ``torch.compile`` (before or after) runs the policy's retain /
    recompute decisions as selective-checkpoint tags and, for a policy planned with ``compile=``,
    its compressed ops through `saved_codecs`; offload is refused when the block is traced
    (docs/compile.md).

    Args:
        model: the model to patch (or a wrapper of it: PEFT, DDP, ``torch.compile``).
        policy: the policy to run (`solve_policy`, `uniform_policy` & co., `Policy.load`).
        host_cap: the most bytes of host memory offloaded tensors may hold (None: half the host
            memory available when the first offloading policy is installed; `runtime.offload`).

    Returns:
        The `AdaccHandle`: ``handle.remove()``, or use it as a context manager
        (``with apply_adacc(model, policy): ...``).

    Raises:
        AlreadyAppliedError: the model is patched already (``handle.remove()`` first, or
            ``handle.set_policy(new_policy)``).
        PolicyError: `policy` was not made for this model's family and structure.
        AdaccError: transformers' own gradient checkpointing is on (Adacc replaces it).
    """
    base = unwrap_model(model)
    existing = base.__dict__.get(_HANDLE_ATTR)
    if existing is not None and existing.active:
        raise AlreadyAppliedError(
            "adacc is already applied to this model: call handle.remove() first, or "
            "handle.set_policy(new_policy) to switch policies"
        )
    policy.validate(base)
    for group in get_adapter(base).block_groups(base):
        for block in group.modules:
            if getattr(block, "gradient_checkpointing", False) is True:
                raise AdaccError(
                    "transformers' gradient checkpointing is enabled on this model; adacc replaces "
                    "it. Call model.activation_checkpointing_disable() (gradient_checkpointing_"
                    "disable() before transformers 5.23) and leave TrainingArguments."
                    "gradient_checkpointing off before applying adacc"
                )
    handle = AdaccHandle(base, policy, host_cap)
    handle._install()
    return handle
