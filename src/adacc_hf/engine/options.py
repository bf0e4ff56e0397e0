"""`AdaccConfig`'s fields as typed keywords: what `prepare` and `AdaccCallback` take by name.

Each key is the `AdaccConfig` field of the same name, with its type; what it does is said once,
in `AdaccConfig`'s docstring (``help(adacc_hf.AdaccConfig)``). `tests/package/test_api_docs.py` holds the
keys to the fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from typing_extensions import TypedDict

if TYPE_CHECKING:
    import torch

__all__ = ["AdaccOptions", "SessionOptions"]


class SessionOptions(TypedDict, total=False):
    """`AdaccConfig`'s fields but those `prepare` names itself (budget, codecs, adaptive,
    auto_batch_size)."""

    codec_backends: list[str] | None
    zscore_threshold: float
    max_tracking_interval: int
    solver: str
    solver_time_limit: float
    max_codec_error: float
    max_grad_error: float | None
    split_blocks: bool
    head: str
    # `prepare` also takes the loop's optimizer object (its name is read off it)
    optimizer: str | torch.optim.Optimizer
    fp32_embeddings: bool
    mixed_precision: str | None
    gradient_accumulation_steps: int
    max_seq_len: int | None
    zero_stage: int
    fsdp: bool
    world_size: int
    offload_optimizer: bool
    master_weights: bool
    ddp: bool
    zero_buckets: int | None
    profile_repeats: int
    headroom: float | None
    expandable_segments: bool
    allocator: str
    profile_from: str | None
    offload: bool | None
    offload_host_cap: int | str | None
    compile: bool | str | None


class AdaccOptions(SessionOptions, total=False):
    """Every `AdaccConfig` field (`AdaccCallback`'s keywords)."""

    budget: int | str
    codecs: list[str] | None
    adaptive: bool
    auto_batch_size: bool
