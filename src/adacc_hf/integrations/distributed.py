"""Distributed runs (DDP, DeepSpeed ZeRO, FSDP2): one policy on every rank, switches in lockstep.

* Every rank profiles: under ZeRO-3 and FSDP the profiling forwards all-gather parameters, so all
  ranks must run them together. Only rank 0 solves; `broadcast_policy` hands its policy to the
  others, so every rank runs the same policy (same `Policy.fingerprint()`).
* Evolution: tracking steps follow a schedule that depends only on the step and on past switches,
  so every rank tracks at the same steps. `gather_tracker` merges every rank's samples (in rank
  order) so all ranks fold the same statistics into their profile; rank 0 alone decides whether to
  switch and broadcasts the result, so all ranks switch at the same step.
* The memory budget is per device. `sharding_from_trainer` / `sharding_from_model` fill the
  `AdaccConfig` fields the static memory model needs (ZeRO stage, FSDP, world size, optimizer
  offload, DeepSpeed's fp32 master weights).

`attach(session)` wires a session; it does nothing outside an initialised process group of two
or more ranks. `AdaccCallback` and `adacc_hf.prepare` call it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..errors import AdaccError
from ..policy import Policy

if TYPE_CHECKING:
    from torch import nn

    from ..evolution import OutlierTracker
    from .session import AdaccSession

__all__ = [
    "attach",
    "broadcast_policy",
    "gather_tracker",
    "is_distributed",
    "rank",
    "sharding_from_accelerate",
    "sharding_from_model",
    "sharding_from_trainer",
    "world_size",
]


def is_distributed() -> bool:
    """True inside an initialised `torch.distributed` process group of two or more ranks."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _device() -> torch.device | None:
    """Where object collectives stage their bytes: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def broadcast_policy(policy: Policy | None, src: int = 0) -> Policy:
    """Rank `src`'s policy on every rank (other ranks pass None). Outside a process group: identity.

    If rank `src` has no policy (it failed to solve), every rank raises `AdaccError` instead of
    waiting forever.
    """
    if not is_distributed():
        if policy is None:
            raise AdaccError("no policy to broadcast")
        return policy
    me = dist.get_rank()
    payload: list[Any] = [policy.to_json() if me == src and policy is not None else None]
    dist.broadcast_object_list(payload, src=src, device=_device())
    text = payload[0]
    if text is None:
        raise AdaccError(f"rank {src} has no adacc policy to share (see its error above)")
    return policy if me == src and policy is not None else Policy.from_json(text)


def gather_tracker(tracker: OutlierTracker) -> OutlierTracker:
    """`tracker` with every rank's samples (rank order), identical on every rank."""
    if not is_distributed():
        return tracker
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(tracker.samples))  # NCCL: the current GPU
    tracker.samples.clear()
    for samples in gathered:
        for key, values in samples.items():
            tracker.samples[key].extend(values)
    return tracker


def attach(session: AdaccSession, src: int = 0) -> AdaccSession:
    """Make `session` share rank `src`'s policy and decisions (no-op outside a process group)."""
    if not is_distributed():
        return session
    session.leader = dist.get_rank() == src
    session.broadcast = lambda policy: broadcast_policy(policy, src)
    session.gather = gather_tracker
    return session


# ------------------------------------------------------------------------------ sharding


def _zero_fields(ds_config: dict[str, Any], n: int) -> dict[str, Any]:
    """DeepSpeed: the ZeRO stage, optimizer offload, and fp32 master weights when it trains in
    bf16 / fp16 (values still "auto" count as off)."""
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    stage = int(stage) if str(stage).isdigit() else 0
    offload = zero.get("offload_optimizer") or {}
    device = str(offload.get("device", "none")).lower() if isinstance(offload, dict) else "none"
    half = any(
        str((ds_config.get(k) or {}).get("enabled", False)).lower() == "true"
        for k in ("bf16", "fp16")
    )
    return {
        "zero_stage": stage,
        "fsdp": False,
        "world_size": n,
        "offload_optimizer": device in ("cpu", "nvme"),
        "master_weights": half,
    }


def _fsdp_fields(reshard: Any, offload: bool, n: int) -> dict[str, Any]:
    """FSDP full sharding (FSDP2 always; FSDP1 FULL/HYBRID_SHARD) shards parameters too;
    FSDP1 SHARD_GRAD_OP keeps them whole between forward and backward (ZeRO-2-like)."""
    name = str(getattr(reshard, "name", reshard)).upper()
    if name == "NO_SHARD":
        return {"zero_stage": 0, "fsdp": False, "world_size": n, "offload_optimizer": offload}
    if name in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2", "_HYBRID_SHARD_ZERO2"):
        return {"zero_stage": 2, "fsdp": False, "world_size": n, "offload_optimizer": offload}
    return {"zero_stage": 0, "fsdp": True, "world_size": n, "offload_optimizer": offload}


def sharding_from_trainer(args: Any) -> dict[str, Any]:
    """`AdaccConfig` sharding fields of a `TrainingArguments` run (DeepSpeed config, FSDP options,
    or an Accelerate launch config), as `dataclasses.replace` keywords. Empty when not sharded."""
    n = max(1, int(getattr(args, "world_size", 1) or 1))
    hf_ds = getattr(args, "hf_deepspeed_config", None)
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    if getattr(args, "deepspeed", None) and hf_ds is not None:
        fields = _zero_fields(hf_ds.config, n)
    elif getattr(args, "fsdp", None) and isinstance(fsdp_config, dict):
        version = int(fsdp_config.get("version", 2))
        reshard = fsdp_config.get("reshard_after_forward", True if version == 2 else "full_shard")
        offload = bool(fsdp_config.get("cpu_offload", False))
        fields = _fsdp_fields("FULL_SHARD" if version == 2 else reshard, offload, n)
    else:
        fields = sharding_from_accelerate(n)
    if not (getattr(args, "bf16", False) or getattr(args, "fp16", False)):
        fields.pop("master_weights", None)  # the static model needs the precision to count them
    return fields


def sharding_from_accelerate(n: int | None = None) -> dict[str, Any]:
    """Sharding fields from Accelerate's state (an `accelerate launch --config_file` run)."""
    from accelerate.state import AcceleratorState, is_initialized

    if not is_initialized():
        return {}
    state = AcceleratorState()
    n = n or state.num_processes
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is not None:
        return _zero_fields(plugin.deepspeed_config, n)
    fsdp = getattr(state, "fsdp_plugin", None)
    if fsdp is not None:
        version = getattr(fsdp, "fsdp_version", 1)
        co = getattr(fsdp, "cpu_offload", None)  # FSDP1 CPUOffload, FSDP2 (CPU)OffloadPolicy
        offload = (
            bool(getattr(co, "offload_params", False)) or type(co).__name__ == "CPUOffloadPolicy"
        )
        reshard = "FULL_SHARD" if version == 2 else getattr(fsdp, "reshard_after_forward", None)
        return _fsdp_fields(reshard, offload, n)
    return {}


def sharding_from_model(model: nn.Module) -> dict[str, Any]:
    """Sharding fields read off a model: a DeepSpeed engine, ZeRO-3 partitioned parameters, or
    FSDP2 (`fully_shard`) DTensor parameters. Empty when nothing is sharded."""
    n = world_size()
    stage = getattr(model, "zero_optimization_stage", None)
    if callable(stage):  # a DeepSpeed engine
        offload = bool(model.zero_use_cpu_optimizer())
        return {
            "zero_stage": int(stage()),
            "fsdp": False,
            "world_size": n,
            "offload_optimizer": offload,
        }
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        return {"zero_stage": 3, "fsdp": False, "world_size": n}
    from torch.distributed.tensor import DTensor

    for p in params:
        if isinstance(p, DTensor):
            return {"zero_stage": 0, "fsdp": True, "world_size": p.device_mesh.size()}
    return {}
