"""Sharding read off a run, for the static memory model (per-device budgets).

`sharding_from_trainer` / `sharding_from_accelerate` / `sharding_from_model` return the
`RunFacts` fields that matter (ZeRO stage, FSDP, DDP, world size, optimizer offload, DeepSpeed's
fp32 master weights) as keywords; empty when a single process trains. `facts.RunFacts` reads them
off the run (`from_training_args`, `from_loop`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .coordinator import world_size

if TYPE_CHECKING:
    from torch import nn

__all__ = ["sharding_from_accelerate", "sharding_from_model", "sharding_from_trainer"]

DS_REDUCE_BUCKET = 500_000_000  # DeepSpeed's default `reduce_bucket_size` (elements)


def _zero_fields(ds_config: dict[str, Any], n: int) -> dict[str, Any]:
    """DeepSpeed: the ZeRO stage, optimizer offload, and fp32 master weights when it trains in
    bf16 / fp16 (values still "auto" count as off) or under ZeRO-1/2 (always an fp32 partition)."""
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    stage = int(stage) if str(stage).isdigit() else 0
    offload = zero.get("offload_optimizer") or {}
    device = str(offload.get("device", "none")).lower() if isinstance(offload, dict) else "none"
    half = any(
        str((ds_config.get(k) or {}).get("enabled", False)).lower() == "true"
        for k in ("bf16", "fp16")
    )
    fields = {
        "zero_stage": stage,
        "fsdp": False,
        "world_size": n,
        "offload_optimizer": device in ("cpu", "nvme"),
        "master_weights": half or stage in (1, 2),
    }
    if stage == 2:
        fields["zero_buckets"] = zero_buckets(
            _number(zero.get("reduce_bucket_size", DS_REDUCE_BUCKET)),
            _on(zero.get("overlap_comm", False)),
            _on(zero.get("contiguous_gradients", True)),
        )
    return fields


def _number(value: Any) -> int | None:
    """A DeepSpeed size (``5e8``, ``"5e8"``, 500000000); None for "auto" or anything else."""
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return None


def _on(value: Any) -> bool:
    return str(value).lower() == "true"


def zero_buckets(size: int | None, overlap_comm: bool, contiguous: bool) -> int | None:
    """Gradient elements ZeRO-2's reduce buckets hold through backward: `size` once, twice with
    `overlap_comm` (double buffering), none without `contiguous` gradients; None: size unknown."""
    if not contiguous:
        return 0
    return None if size is None else size * (2 if overlap_comm else 1)


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
    """`RunFacts` sharding fields of a `TrainingArguments` run (DeepSpeed config, FSDP options,
    or an Accelerate launch config), as keywords. Empty when not sharded."""
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
    half = getattr(args, "bf16", False) or getattr(args, "fp16", False)
    if not half and fields.get("zero_stage") not in (1, 2):
        fields.pop("master_weights", None)  # fp32 parameters: only ZeRO-1/2 copy them
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
    if str(state.distributed_type).split(".")[-1].startswith("MULTI_") and n > 1:
        return {"ddp": True, "world_size": n}  # Accelerate wraps the model in DDP
    return {}


def sharding_from_model(model: nn.Module) -> dict[str, Any]:
    """Sharding fields read off a model: a DeepSpeed engine, ZeRO-3 partitioned parameters, FSDP2
    (`fully_shard`) DTensor parameters or a DDP wrapper; else Accelerate's state (a model
    prepared before `Accelerator.prepare` wraps it). Empty when a single process trains."""
    from torch.nn.parallel import DistributedDataParallel

    n = world_size()
    if isinstance(model, DistributedDataParallel) and n > 1:
        return {"ddp": True, "world_size": n}
    stage = getattr(model, "zero_optimization_stage", None)
    if callable(stage):  # a DeepSpeed engine
        offload = bool(model.zero_use_cpu_optimizer())
        fields = {
            "zero_stage": int(stage()),
            "fsdp": False,
            "world_size": n,
            "offload_optimizer": offload,
        }
        if fields["zero_stage"] in (1, 2):
            fields["master_weights"] = True  # ZeRO-1/2 clone an fp32 partition of the parameters
        if fields["zero_stage"] == 2:
            fields["zero_buckets"] = zero_buckets(
                int(model.zero_reduce_bucket_size()),
                bool(model.zero_overlap_comm()),
                bool(model.zero_contiguous_gradients()),
            )
        return fields
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        return {"zero_stage": 3, "fsdp": False, "world_size": n}
    from torch.distributed.tensor import DTensor

    for p in params:
        if isinstance(p, DTensor):
            return {"zero_stage": 0, "fsdp": True, "world_size": p.device_mesh.size()}
    if n == 1:
        return {}
    try:
        return sharding_from_accelerate()
    except ImportError:  # pragma: no cover - Accelerate is optional here
        return {}
