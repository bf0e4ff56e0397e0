"""Plain PyTorch models: blocks the user names, a loss the user gives.

A model that is not a transformers model (a nanoGPT, a torchtitan-style LLaMA, a ViT) has no
`GradientCheckpointingLayer` blocks and maybe no loss in its output. `register` records, per model
instance, which of its modules are the blocks (module objects, or path patterns such as
``"layers.*"``, one ``*`` per path component) and how a batch's loss is computed
(``loss(output, batch)``; by default the loss the model returns). `get_adapter` then answers
with a `PlainAdapter` for that model: its blocks grouped by class (blocks of one class must share
one structure and share one profile), their ops typed by the generic rules (`rules`).

The runtime reaches a plain block through `forward.hook_forward`, and calls a plain model on a
batch (a mapping of its forward's arguments, plus what its loss reads) through
`forward.model_inputs`.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .base import Adapter, unwrap_model
from .generic import _kind, gradient_checkpointing_layer
from .rules import Roles, class_name, submodule_roles

__all__ = [
    "BlocksSpec",
    "LossFn",
    "PlainAdapter",
    "PlainModel",
    "declare",
    "plain_model",
    "register",
    "registered",
    "unregister",
]

#: ``loss(model_output, batch) -> scalar tensor``.
LossFn = Callable[[Any, Mapping[str, Any]], torch.Tensor]
#: What ``blocks=`` takes: a path pattern, a container of blocks, or blocks / paths / patterns.
BlocksSpec = str | nn.Module | Iterable[nn.Module | str]


@dataclass
class PlainModel:
    """What `register` recorded for one model: its blocks' paths (in forward order once a
    forward has run them: `checked`) and its loss."""

    paths: list[str]
    loss: LossFn | None
    model_type: str
    checked: bool = False  # a forward ran every block once (`runtime.plain.check_forward`)
    adapter: PlainAdapter = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.adapter = PlainAdapter(self)

    def loss_of(self, out: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        """The batch's loss: ``loss(out, batch)``, or the loss the model returned."""
        if self.loss is not None:
            try:
                value = self.loss(out, batch)
            except KeyError as e:
                raise UnsupportedModelError(
                    f"loss= read {e} from a batch with keys {sorted(batch)}: a batch planned at a "
                    "training forward holds the forward's own arguments only. Give prepare a "
                    "sample_batch with every key the loss reads (or call session.setup(batch) "
                    "before the first forward of each new batch shape)"
                ) from e
        else:
            value = _returned_loss(out)
            if value is None:
                raise UnsupportedModelError(
                    f"{self.model_type}'s forward returns {_kind_of(out)}, not a loss: pass "
                    "prepare(..., loss=lambda out, batch: ...) computing the scalar loss from the "
                    "model's output and the batch"
                )
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise UnsupportedModelError(
                f"loss= returned {_kind_of(value)}: it must return the batch's scalar loss tensor"
            )
        return value


def _kind_of(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} ({', '.join(type(v).__name__ for v in x)})"
    return f"a {type(x).__name__}"


def _is_scalar(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.numel() == 1 and x.is_floating_point()


def _returned_loss(out: Any) -> torch.Tensor | None:
    """The loss a forward returned: a scalar tensor, ``out["loss"]`` / ``out.loss``, or the one
    scalar tensor of a tuple (nanoGPT returns ``(logits, loss)``)."""
    if _is_scalar(out):
        return out
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if _is_scalar(loss):
        return loss
    if isinstance(out, (tuple, list)):
        scalars = [v for v in out if _is_scalar(v)]
        if len(scalars) == 1:
            return scalars[0]
    return None


_MODELS: weakref.WeakKeyDictionary[nn.Module, PlainModel] = weakref.WeakKeyDictionary()


def plain_model(model: nn.Module) -> PlainModel | None:
    """What `register` recorded for `model` (or the model inside its wrappers), if anything."""
    return registered(unwrap_model(model))


def registered(base: nn.Module) -> PlainModel | None:
    """What `register` recorded for `base`, a model already unwrapped (`unwrap_model`), if
    anything: `plain_model` for a caller that unwraps once, where its path begins.

    Args:
        base: the innermost model (a wrapper is not looked through: pass ``unwrap_model(m)``).
    """
    return _MODELS.get(base)


def unregister(model: nn.Module) -> None:
    """Forget `register`'s record of `model` (it is read through transformers' classes again)."""
    _MODELS.pop(unwrap_model(model), None)


def register(
    model: nn.Module, blocks: BlocksSpec | None = None, loss: LossFn | None = None
) -> PlainModel:
    """Record `model`'s blocks and loss, for `get_adapter` and the runtime.

    Args:
        model: the model (or a wrapper of it: DDP, PEFT, Accelerate).
        blocks: the repeated blocks: a path pattern (``"layers.*"``, ``"transformer.h.*"``; ``*``
            matches one path component), a container of them (``model.layers``), or a list of
            modules, paths or patterns. None: transformers' `GradientCheckpointingLayer` blocks.
        loss: ``loss(output, batch)`` returning the scalar loss, when the model returns none.

    Returns:
        The record (`PlainModel`).

    Raises:
        UnsupportedModelError: no module matches, a block is nested in another, or blocks of one
            class differ in structure (the message says what to change).
    """
    return _record(unwrap_model(model), blocks, loss)


def declare(base: nn.Module, blocks: BlocksSpec | None, loss: LossFn | None) -> None:
    """`register` `base`'s blocks and loss where either is given, else forget an earlier record
    (an earlier `prepare`'s blocks no longer apply).

    Args:
        base: the model, unwrapped (`unwrap_model`).
        blocks: the repeated blocks (see `register`), or None.
        loss: the loss function (see `register`), or None.
    """
    if blocks is None and loss is None:
        _MODELS.pop(base, None)
    else:
        _record(base, blocks, loss)


def _record(base: nn.Module, blocks: BlocksSpec | None, loss: LossFn | None) -> PlainModel:
    paths = resolve_blocks(base, blocks)
    config_type = getattr(getattr(base, "config", None), "model_type", None)
    model_type = config_type if isinstance(config_type, str) else f"plain:{type(base).__name__}"
    spec = PlainModel(paths, loss, model_type)
    spec.adapter.check(base)
    _MODELS[base] = spec
    return spec


def _matches(pattern: str, path: str) -> bool:
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(
        fnmatch.fnmatchcase(h, w) for w, h in zip(want, have, strict=True)
    )


def _candidates(base: nn.Module) -> list[str]:
    """Patterns of the containers holding two or more modules of one class (likely blocks)."""
    out = []
    for path, m in base.named_modules():
        kinds = [type(k) for k in m.children()]
        containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
        if isinstance(m, containers) and len(kinds) > 1 and len(set(kinds)) == 1:
            out.append(f"{path}.*" if path else "*")
    return out


def resolve_blocks(base: nn.Module, blocks: BlocksSpec | None) -> list[str]:
    """The module paths `blocks` names in `base` (see `register`), in module order."""
    order = {path: i for i, (path, _) in enumerate(base.named_modules())}
    by_id = {id(m): path for path, m in base.named_modules()}
    if blocks is None:
        gcl = gradient_checkpointing_layer()
        found = [p for p, m in base.named_modules() if gcl is not None and isinstance(m, gcl)]
        items: list[nn.Module | str] = [
            p for p in found if not any(p.startswith(q + ".") for q in found)
        ]
        if not items:
            raise UnsupportedModelError(
                f"{type(base).__name__} has no transformers GradientCheckpointingLayer blocks: "
                "name its repeated blocks with blocks= (a path pattern such as "
                f"{_example(base)}, or a list of the block modules)"
            )
    elif isinstance(blocks, str):
        items = [blocks]
    elif isinstance(blocks, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
        items = list(blocks.children())
    elif isinstance(blocks, nn.Module):
        items = [blocks]
    else:
        items = list(blocks)
    paths: list[str] = []
    for item in items:
        if isinstance(item, nn.Module):
            path = by_id.get(id(item))
            if path is None:
                raise UnsupportedModelError(
                    f"blocks=: a {type(item).__name__} given is not a submodule of "
                    f"{type(base).__name__}: pass the model's own block modules"
                )
            found = [path]
        elif isinstance(item, str):
            found = [p for p in order if p and _matches(item, p)]
            if not found:
                raise UnsupportedModelError(
                    f"blocks={item!r} matches no module of {type(base).__name__} (a pattern "
                    "matches whole module paths, `*` one path component): try "
                    f"{_example(base)}"
                )
        else:
            raise UnsupportedModelError(
                f"blocks= takes modules, paths or patterns, not {type(item).__name__}"
            )
        for p in found:  # a list of blocks named stands for its blocks (it has no forward)
            mod = base.get_submodule(p) if p else base
            kids = [f"{p}.{k}" for k, _ in mod.named_children()]
            if isinstance(mod, (nn.ModuleList, nn.ModuleDict)) and kids:
                paths += [k for k in kids if k not in paths]
            elif p not in paths:
                paths.append(p)
    if "" in paths:
        raise UnsupportedModelError(
            f"blocks= names the model itself: name its repeated blocks (e.g. {_example(base)})"
        )
    for p in paths:
        outer = next((q for q in paths if p.startswith(q + ".")), None)
        if outer is not None:
            raise UnsupportedModelError(
                f"blocks= names {p!r} inside another block {outer!r}: name only the outermost "
                "repeated blocks"
            )
    return sorted(paths, key=order.__getitem__)


def _example(base: nn.Module) -> str:
    found = _candidates(base)
    return " or ".join(repr(c) for c in found[:3]) if found else "'layers.*'"


def _structure(block: nn.Module) -> tuple:
    tree = tuple((p, class_name(m)) for p, m in block.named_modules() if p)
    tensors = tuple(
        (n, tuple(t.shape), str(t.dtype))
        for n, t in [*block.named_parameters(), *block.named_buffers()]
    )
    return tree, tensors, _kind(block)


_PARTS = ("submodules", "parameter or buffer shapes / dtypes", "attention kind attributes")


class PlainAdapter(Adapter):
    """A registered model's blocks (see the module docstring), grouped by class."""

    name = "plain"
    version = 1

    def __init__(self, spec: PlainModel) -> None:
        self.spec = spec

    def find_blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        base = unwrap_model(model)
        return [(p, base.get_submodule(p)) for p in self.spec.paths]

    def signature(self, path: str, block: nn.Module) -> tuple:
        return (class_name(block),)

    def group_names(self, signatures: list[tuple], blocks: list[nn.Module]) -> list[str]:
        if len(signatures) == 1:
            return ["block"]
        names = [_snake(s[0]) for s in signatures]
        return [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]

    def roles(self, block: nn.Module) -> Roles:
        return submodule_roles(block)

    def model_type(self, model: nn.Module) -> str:
        return self.spec.model_type

    def check(self, model: nn.Module) -> None:
        """Blocks of one class share one profile: they must share one structure."""
        first: dict[str, tuple[str, tuple]] = {}
        for path, block in self.find_blocks(model):
            cls, here = class_name(block), _structure(block)
            if cls not in first:
                first[cls] = (path, here)
                continue
            other, there = first[cls]
            if here != there:
                what = next(n for n, a, b in zip(_PARTS, here, there, strict=True) if a != b)
                raise UnsupportedModelError(
                    f"blocks {other!r} and {path!r} are both {cls} but differ in {what}: blocks "
                    "of one class share one profile. Give the blocks of the other structure a "
                    "class of their own (a subclass will do), or leave them out of blocks="
                )


def _snake(name: str) -> str:
    out = "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
    return out or "block"
