"""The chunked LM head: a causal LM's training loss without its ``[tokens x vocab]`` logits.

`HeadPatch(model)` patches one model instance (never its class): while the model trains with
``labels`` and gradients on, its output embedding (``lm_head``) hands the loss the final hidden
states instead of computing logits, and the loss is computed chunk by chunk
(`head_loss.chunked_linear_ce_sum`) with HF's ``ForCausalLMLoss`` semantics: labels shifted
left by one (or ``shift_labels`` as given), ``ignore_index`` (-100) left out, the mean over
counted tokens, or ``sum / num_items_in_batch`` when the Trainer passes it (gradient
accumulation). Such a forward returns ``logits=None``: the logits never exist. Without labels, in
eval mode or under ``no_grad``, the model runs as it was. `remove()` restores the instance.

A model whose forward changes the logits between ``lm_head`` and the loss (Gemma-2's final
softcapping, Granite's scaling, Cohere's ``logit_scale``) cannot take it: known cases are refused
before any forward (`chunked_head_problem`), and any other is caught at its first forward (the
loss does not receive ``lm_head``'s own output) with an error instead of a wrong loss.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters import unwrap_model
from ..errors import AdaccError
from .head_loss import chunked_linear_ce_sum

_PATCH_ATTR = "_adacc_head"
# Config fields of models whose forward rescales the logits before their loss.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_softcapping",
    "logits_scaling",
    "logit_scale",
    "output_multiplier_scale",
)


def _forward_replaced(base: nn.Module) -> bool:
    """Someone (TRL's fused LM head, Liger, Unsloth) replaced `base.forward` on the instance;
    Accelerate's mixed-precision wrapper (which keeps the class's own as ``_original_forward``)
    does not count."""
    if "forward" not in base.__dict__:
        return False
    original = base.__dict__.get("_original_forward")
    return original is None or getattr(original, "__func__", None) is not type(base).forward


@functools.cache
def _causal_lm_classes() -> frozenset[str]:
    """Class names of transformers' causal-LM auto classes."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([v] if isinstance(v, str) else v)
    return frozenset(names)


def _is_causal_lm(base: nn.Module) -> bool:
    config = getattr(base, "config", None)
    return type(base).__name__ in _causal_lm_classes() and not getattr(
        config, "is_encoder_decoder", False
    )


def chunked_head_problem(model: nn.Module) -> str | None:
    """Why `model` cannot take the chunked head, or None when it can."""
    base = unwrap_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        kind = type(head).__name__ if head is not None else "none"
        return f"its output embedding is not an nn.Linear ({kind})"
    if "labels" not in inspect.signature(base.forward).parameters:
        return "its forward takes no labels"
    if _forward_replaced(base):
        return "its forward is replaced on the instance (e.g. TRL's fused LM head), which owns the head"
    if not _is_causal_lm(base):
        # `loss_function` defaults to ForCausalLMLoss on every model, even those (T5, BERT) whose
        # forward computes another loss itself.
        return f"{type(base).__name__} is not a causal LM (transformers' causal-LM auto classes)"
    from transformers.loss.loss_utils import LOSS_MAPPING

    loss = base.loss_function
    owner = getattr(loss, "__self__", None)
    if isinstance(owner, HeadPatch):  # our own patch is on: judge the model's loss under it
        loss = owner._hf_loss
    if loss is not LOSS_MAPPING["ForCausalLM"]:
        return "its loss is not transformers' ForCausalLMLoss"
    config = getattr(base, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            return f"its forward rescales the logits before the loss (config.{name}={value})"
    return None


def chunked_causal_lm_loss(
    head: nn.Linear,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    *,
    chunk_rows: int | None = None,
    use_torch: bool | None = None,
    **_: Any,
) -> torch.Tensor:
    """HF's ``ForCausalLMLoss(head(hidden), labels, ...)`` without the logits: the mean over
    counted tokens, or their sum / `num_items_in_batch`. Under autocast, the hidden states and
    the weight are cast to its dtype (as autocast's linear would) and reduced in fp32."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("the causal LM loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(hidden.device)
    x = hidden.reshape(-1, hidden.shape[-1])
    weight, bias = head.weight, head.bias
    amp = torch.is_autocast_enabled(x.device.type)
    if amp:  # what autocast's linear would compute in: cast once, then run without it
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    ctx = torch.autocast(x.device.type, enabled=False) if amp else contextlib.nullcontext()
    with ctx:
        total = chunked_linear_ce_sum(
            x,
            weight,
            bias,
            target,
            ignore_index=ignore_index,
            chunk_rows=chunk_rows,
            use_torch=use_torch,
        )
    if num_items_in_batch is None:
        return total / (target != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _keeps_all(logits_to_keep: Any) -> bool:
    """HF's ``logits_to_keep``: 0 (an int) keeps every position."""
    return isinstance(logits_to_keep, int) and logits_to_keep == 0


class HeadPatch:
    """The chunked head on one model instance; ``remove()`` undoes it. See the module docstring."""

    def __init__(
        self, model: nn.Module, chunk_rows: int | None = None, use_torch: bool | None = None
    ) -> None:
        """`chunk_rows`: tokens per chunk (default `head_loss.default_chunk_rows`); `use_torch`:
        torch's ``linear_cross_entropy`` (default: where it exists) or the hand-written path."""
        base = unwrap_model(model)
        problem = chunked_head_problem(base)
        if problem is not None:
            raise AdaccError(f"the chunked LM head does not apply to this model: {problem}")
        if base.__dict__.get(_PATCH_ATTR) is not None:
            raise AdaccError("the chunked LM head is already applied to this model")
        self.model = base
        self.head: nn.Linear = base.get_output_embeddings()
        self.chunk_rows = chunk_rows
        self.use_torch = use_torch
        self._armed = False
        self._hidden: torch.Tensor | None = None
        self._placeholder: torch.Tensor | None = None
        self._head_forward = self.head.__dict__.get("forward")
        self._hf_loss = base.loss_function
        self.head.forward = self._head_call  # instance attribute: the class is untouched
        base.loss_function = self._loss  # transformers' own setter (an instance attribute)
        self._handles = [
            base.register_forward_pre_hook(self._pre, with_kwargs=True),
            base.register_forward_hook(self._post, always_call=True),
        ]
        base.__dict__[_PATCH_ATTR] = self
        self.active = True

    # -------------------------------------------------------------------------- hooks
    def _pre(self, module: nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        # A patch removed while the model's pre-hooks run (a policy switch in the session's own
        # pre-hook) is still called once, without kwargs: it has nothing to do then.
        if self.active and kwargs is not None:
            self.arm(module, kwargs)

    def arm(self, module: nn.Module, kwargs: dict) -> None:
        """Decide for the forward about to run whether the head is chunked. The pre-hook calls
        this; a patch installed by another pre-hook of the same forward (which torch does not
        call then) must be armed by whoever installed it."""
        self._hidden = self._placeholder = None
        self._armed = (
            module.training
            and torch.is_grad_enabled()
            and kwargs.get("labels") is not None
            and _keeps_all(kwargs.get("logits_to_keep", 0))
        )

    def _post(self, module: nn.Module, args: tuple, out: Any) -> Any:
        used = self._armed and self._placeholder is not None
        unused = used and self._hidden is not None
        self._armed = False
        self._hidden = self._placeholder = None
        if unused:  # the forward did not hand lm_head's output to its loss_function
            raise AdaccError(
                f"{type(module).__name__} does not compute its loss through loss_function: the "
                "chunked LM head cannot apply; use head='full'"
            )
        if used and out is not None and hasattr(out, "logits"):
            out.logits = None
        return out

    def _head_call(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self._armed or self._placeholder is not None:
            return nn.Linear.forward(self.head, hidden)
        self._hidden = hidden
        self._placeholder = hidden.new_empty(*hidden.shape[:-1], 0)
        return self._placeholder

    def _loss(
        self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, **kwargs: Any
    ) -> torch.Tensor:
        hidden = self._hidden
        if hidden is None or self._placeholder is None:  # not armed: HF's own loss
            return self._hf_loss(logits, labels, vocab_size, **kwargs)
        self._hidden = None
        if logits is not self._placeholder:
            raise AdaccError(
                f"{type(self.model).__name__} changes the logits between its lm_head and its loss "
                "(softcapping or scaling): the chunked LM head cannot apply; use head='full'"
            )
        return chunked_causal_lm_loss(
            self.head,
            hidden,
            labels,
            chunk_rows=self.chunk_rows,
            use_torch=self.use_torch,
            **kwargs,
        )

    # -------------------------------------------------------------------------- undo
    def remove(self) -> None:
        """Restore the model instance as it was. Safe to call twice."""
        if not self.active:
            return
        for h in self._handles:
            h.remove()
        if self._head_forward is None:
            self.head.__dict__.pop("forward", None)
        else:
            self.head.forward = self._head_forward
        self.model.__dict__.pop("_loss_function", None)
        self.model.__dict__.pop(_PATCH_ATTR, None)
        self._hidden = self._placeholder = None
        self.active = False

    def __enter__(self) -> HeadPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
