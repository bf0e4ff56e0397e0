"""What a profile's measurements depend on, so a saved one is reused only where they hold.

`run_fingerprint` names, as short strings, everything outside the batch that moves a profile's
bytes or times: the model's configuration and attention / experts implementation, its parameters
(names, shapes, dtypes, which train: a LoRA run is not a full fine-tune), the autocast, the device
(its name; on a CPU the thread count), the codecs profiled, the torch.compile backend (where the
blocks were measured compiled), and the library versions. The session
adds the bucket. `differences` says what changed, for the log line of a profile not reused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .._version import __version__
from ..adapters import get_adapter

__all__ = ["differences", "run_fingerprint"]

# Config entries that say where a model came from, not what it computes.
_PROVENANCE = {"_name_or_path", "transformers_version", "_commit_hash", "use_cache"}


def _digest(obj: Any) -> str:
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_fingerprint(
    model: nn.Module,
    autocast: torch.dtype | None,
    codecs: Iterable[str] | None = None,
    codec_params: Mapping[str, Mapping[str, Any]] | None = None,
    compile: str | None = None,
    codec_backends: Iterable[str] | None = None,
) -> dict[str, str]:
    """The fingerprint of profiling `model` (the unwrapped transformers model) now; `compile`:
    the torch.compile backend its blocks were measured under, `codec_backends` the codec
    backends timed (an entry each only when set)."""
    import transformers

    config = getattr(model, "config", None)
    if hasattr(config, "to_dict"):
        entries = {k: v for k, v in config.to_dict().items() if k not in _PROVENANCE}
    else:  # a plain PyTorch model (`adapters.plain`): its module tree
        entries = {p: type(m).__name__ for p, m in model.named_modules()}
    device = next(model.parameters()).device
    if device.type == "cuda":
        where = f"cuda ({torch.cuda.get_device_name(device)})"
    else:
        where = f"{device.type} ({torch.get_num_threads()} threads)"
    params = [
        (n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()
    ]
    out = {
        "model": f"{get_adapter(model).model_type(model)} {_digest(entries)}",
        "implementation": (
            f"attention {getattr(config, '_attn_implementation', None)}, "
            f"experts {getattr(config, '_experts_implementation', None)}"
        ),
        "parameters": f"{sum(p.numel() for p in model.parameters() if p.requires_grad)} trainable "
        f"{_digest(params)}",
        "autocast": str(autocast),
        "device": where,
        "codecs": _digest([sorted(codecs) if codecs is not None else None, codec_params or {}]),
        "versions": f"adacc-hf {__version__}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
    }
    if compile is not None:
        out["compile"] = compile
    if codec_backends is not None:
        out["codec_backends"] = ",".join(codec_backends)
    return out


def differences(saved: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """``"device: cpu (2 threads) -> cpu (1 threads)"`` for each entry that differs."""
    keys = sorted(set(saved) | set(now))
    return [f"{k}: {saved.get(k)} -> {now.get(k)}" for k in keys if saved.get(k) != now.get(k)]
