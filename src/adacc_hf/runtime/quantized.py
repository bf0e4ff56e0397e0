"""Quantised weights a training step cannot differentiate through.

On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight for inference the first time an
eval-mode forward without gradients runs it (``quant_state.packing_format_for_cpu``, permanently).
The repacked weight's matmul (``gemv_4bit``) has no backward: the gradient a LoRA adapter below it
receives is silently wrong from then on. `check_trainable` raises before such a step runs.
"""

from __future__ import annotations

from torch import nn

from ..errors import AdaccError

__all__ = ["check_trainable", "repacked_for_inference"]


def repacked_for_inference(model: nn.Module) -> list[str]:
    """Names of the 4-bit weights bitsandbytes repacked for CPU inference."""
    return [
        n
        for n, p in model.named_parameters()
        if getattr(getattr(p, "quant_state", None), "packing_format_for_cpu", False)
    ]


def check_trainable(model: nn.Module) -> None:
    """Raise where a quantised weight was repacked for inference (see the module docstring).

    Args:
        model: the model about to run a training forward.
    """
    names = repacked_for_inference(model)
    if names:
        raise AdaccError(
            f"bitsandbytes repacked {len(names)} 4-bit weight(s) for CPU inference ({names[0]}, "
            "...) when an eval-mode forward without gradients ran them; their matmul has no "
            "backward, so training would give wrong gradients. Load the model again and call "
            "model.train() before any forward (from_pretrained returns it in eval mode), and "
            "evaluate with gradients enabled or not on CPU"
        )
