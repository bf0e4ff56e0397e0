"""What a strategy may change on a model, and transformers' own checkpointing switch.

`patch_state` fingerprints every module's checkpointing attributes, hook ids and training flag;
`snapshot` / `restore` put the attributes back. A prepared strategy (`prepared.Prepared`) takes
both around every entry and raises `PatchLeftError` when leaving did not restore the fingerprint.
`hf_enable` / `hf_disable` switch transformers' activation checkpointing as a user does;
`liger_enable` / `liger_disable` Liger-Kernel's fused linear cross-entropy head.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Any

import torch
from torch import nn

_ATTRS = (
    "gradient_checkpointing",
    "_gradient_checkpointing_func",
    "_adacc_handle",
    "_require_grads_hooks",
    "_require_grads_hook",
    "forward",
)
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
)


class PatchLeftError(RuntimeError):
    """A strategy left something behind on the model."""


def patch_state(model: nn.Module) -> dict[str, Any]:
    """What a strategy may change on a model: per module, its checkpointing attributes (by identity
    for objects), its hook ids and its training flag."""
    state = {}
    for name, mod in model.named_modules():
        attrs = {}
        for a in _ATTRS:
            if a in mod.__dict__:
                v = mod.__dict__[a]
                attrs[a] = v if isinstance(v, (bool, int, float, str, type(None))) else id(v)
        hooks = tuple(tuple(getattr(mod, h, {}).keys()) for h in _HOOK_DICTS)
        state[name] = (attrs, hooks, mod.training)
    return state


def snapshot(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Every module's checkpointing attributes, to `restore` later."""
    return {
        name: {a: mod.__dict__[a] for a in _ATTRS if a in mod.__dict__}
        for name, mod in model.named_modules()
    }


def restore(model: nn.Module, saved: dict[str, dict[str, Any]]) -> None:
    for name, mod in model.named_modules():
        before = saved.get(name, {})
        for a in _ATTRS:
            if a in before:
                mod.__dict__[a] = before[a]
            else:
                mod.__dict__.pop(a, None)


def check_unchanged(before: dict[str, Any], model: nn.Module, who: str) -> None:
    """Raise `PatchLeftError` when `model`'s `patch_state` differs from `before`."""
    after = patch_state(model)
    if after != before:
        diff = [k for k in before if before[k] != after.get(k)][:5]
        raise PatchLeftError(f"strategy {who} left the model patched at {diff}")


def hf_enable(model: nn.Module, *, offload: bool, every_n: int = 1) -> None:
    """transformers' own activation checkpointing (non-reentrant), as a user switches it on.

    transformers >= 5.23: ``activation_checkpointing_enable(..., every_n_layers=, offload=)``;
    before that, ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)``. On a machine
    without an accelerator (transformers 5.23 asks for pinned memory there and fails) or a
    transformers without ``offload``, offload is the same wrapper transformers installs:
    ``save_on_cpu`` around each layer's checkpoint. ``every_n > 1`` checkpoints only the layers
    whose index is a multiple of it and keeps the others whole (transformers' ``every_n_layers``;
    on a transformers without it, the same rule applied to the layers' own switch).
    """
    if every_n < 1:
        raise ValueError(f"every_n must be >= 1, got {every_n}")
    kwargs = {"use_reentrant": False}
    new = getattr(model, "activation_checkpointing_enable", None)
    enable = new or model.gradient_checkpointing_enable
    params = inspect.signature(enable).parameters
    native_offload = offload and "offload" in params and torch.cuda.is_available()
    native_every = every_n > 1 and "every_n_layers" in params
    extra: dict[str, Any] = {"offload": True} if native_offload else {}
    if native_every:
        extra["every_n_layers"] = every_n
    if new is not None:
        new(activation_checkpointing_kwargs=kwargs, **extra)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs, **extra)
    if offload and not native_offload:
        from torch.autograd.graph import save_on_cpu
        from torch.utils.checkpoint import checkpoint

        pin = torch.cuda.is_available()

        def offloaded(function, *args, **kw):
            with save_on_cpu(pin_memory=pin):
                return checkpoint(function, *args, **kw)

        func = functools.partial(offloaded, **kwargs)
        for mod in model.modules():
            if "_gradient_checkpointing_func" in mod.__dict__:
                mod._gradient_checkpointing_func = func
    if every_n > 1 and not native_every:
        for i, layer in enumerate(checkpointed_layers(model)):
            layer.gradient_checkpointing = i % every_n == 0


def checkpointed_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks ``every_n_layers`` counts (transformers' `GradientCheckpointingLayer`),
    in model order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def hf_disable(model: nn.Module) -> None:
    off = getattr(model, "activation_checkpointing_disable", None) or (
        model.gradient_checkpointing_disable
    )
    off()
    # transformers adds an input-embedding hook on enable and removes it on disable only for PEFT
    with contextlib.suppress(AttributeError):  # older versions: no hook, no attribute
        model.disable_input_require_grads()


def liger_unavailable(device: torch.device) -> str:
    """Why Liger-Kernel's fused linear cross-entropy cannot be a baseline on `device` ("": it can)."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (
            "Liger's kernels are Triton GPU kernels: on a CPU only Triton's interpreter runs them "
            "(TRITON_INTERPRET=1), as NumPy, whose time and memory say nothing of a GPU's"
        )
    return ""


def liger_enable(model: nn.Module) -> None:
    """Liger's fused linear cross-entropy on `model`, as transformers' ``use_liger_kernel=True``
    applies it (the same entry point), its other kernels left off: the LM head and loss run chunk
    by chunk, the logits never materialised. `liger_disable` takes it off."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    before = model.__dict__.get("forward")
    off = ("cross_entropy", "rms_norm", "swiglu", "rope", "layer_norm", "geglu")
    _apply_liger_kernel_to_instance(
        model=model, fused_linear_cross_entropy=True, **dict.fromkeys(off, False)
    )
    if model.__dict__.get("forward") is before:
        raise ValueError(f"Liger has no fused linear cross-entropy for {model.config.model_type!r}")


def liger_disable(model: nn.Module) -> None:
    model.__dict__.pop("forward", None)  # Liger patches the instance's forward only
