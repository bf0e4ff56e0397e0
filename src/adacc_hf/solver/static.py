"""Static memory: parameters, gradients, optimizer states and master weights, per device.

`estimate_static_memory` predicts it from the model alone (optimizer name as in
``TrainingArguments.optim``, sharding, offload); `measured_static_memory` sums the real bytes after
a step. Rules (per trainable parameter of ``n`` elements at ``e`` bytes each):

* gradients: ``n * e`` (frozen parameters, e.g. a LoRA base model, have none);
* ``adamw_torch*`` / ``adamw`` / ``adam`` / ``adamw_hf``: 2 states at the parameter dtype
  (+ a 4-byte step tensor per parameter for torch's optimizers);
* ``*8bit*`` (bitsandbytes, block size 256): 1 byte per element per state + one fp32 absmax per
  256 elements, for parameters of >= 4096 elements (smaller ones keep fp32 states), + the shared
  256-entry fp32 quantisation maps; with ``fp32_embeddings`` (what the HF Trainer registers with
  bitsandbytes for 8-bit optimizers) ``nn.Embedding`` weights keep fp32 states;
* ``sgd``: no state (torch's default momentum 0); ``sgd_momentum``: 1 state;
* ``adafactor`` (transformers, ``beta1=None``): fp32 row + column statistics for matrices,
  a full fp32 state for vectors, + a 4-byte RMS scalar per parameter;
* ``lion``, ``adagrad``, ``rmsprop``: 1 state (``*_32bit``: fp32 states);
* master weights (``master_weights=True``, DeepSpeed-style mixed precision with 16-bit
  parameters): 4 bytes per element. AMP with fp32 parameters needs no master copy. DeepSpeed's
  ZeRO-1/2 optimizer clones an fp32 partition of every trainable parameter whatever its dtype
  (``single_partition_of_fp32_groups``): with ``master_weights`` (DeepSpeed's readers in
  `engine.sharding` set it) fp32 parameters count too; ZeRO-3 reuses fp32 partitions.

The optimizer step's own temporaries (``optimizer_step``, alive only inside ``optimizer.step()``),
as torch 2.13 and bitsandbytes 0.50 allocate them, measured per optimizer in the tests: on CPU,
where torch's optimizers loop over parameters one at a time, a multiple of the largest trainable
parameter: AdamW / Adagrad / RMSprop 2-2.5x (``sqrt`` then a division), SGD 1x with weight
decay, Adafactor 2-2.5x, bitsandbytes 8-bit 5-6.5x and 32-bit Lion 3-3.5x on CPU; fused AdamW
none. Measurements varied within those ranges by model: the larger multiple is kept. On CUDA torch's foreach
path computes the square roots of every parameter of a group at once: 1x the trainable bytes.

Sharding over ``world_size``: ZeRO-1 divides optimizer states and master weights, ZeRO-2 also
gradients, ZeRO-3 and FSDP (full shard) also parameters. ``offload_optimizer`` keeps optimizer
states and master weights off the device. DeepSpeed's ZeRO-1/2 step runs on one flat fp32
partition (``single_partition_of_fp32_groups``) with one flat fp32 gradient (a copy of the reduced
partition, once more in fp32 when gradients are 16-bit): the multiples above apply to that
partition (``stage_1_and_2.py``, measured per rank).

Communication buffers (``comm``, resident from the engine's construction on, measured per rank in
``tests/integrations/test_distributed.py``): DDP (``ddp=True``, ``gradient_as_bucket_view=False`` as Accelerate
and the HF Trainer leave it) copies each gradient into a flat bucket for its all-reduce: buckets
cover every trainable parameter once, 1x the gradient bytes. (With ``gradient_as_bucket_view=True``
the gradients are views of the buckets: counting them as well over-counts by 1x the gradients.)
DeepSpeed ZeRO-3 allocates its gradient partitions as one flat buffer at start-up
(``grad_partitions_flat_buffer``): the sharded gradients are resident, counted here.

What FSDP2, ZeRO-2 and ZeRO-3 gather, reduce and buffer during the step (not all step long) is
`engines.EngineMemory`, read off the model here and added per moment by the step model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import BudgetError
from ..runtime.peak import optimizer_tensors, quantization_tensors, storage_nbytes
from ..units import fmt_bytes
from .engines import EngineMemory, engine_memory

BNB_BLOCK = 256  # bitsandbytes blockwise quantisation block (elements per fp32 absmax)
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps fp32 states for smaller parameters
BNB_QMAP_NBYTES = 256 * 4  # one 256-entry fp32 quantisation map, shared by all parameters
KNOWN_OPTIMIZERS = (
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_hf",
    "adamw",
    "adam",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "lion",
    "lion_8bit",
    "lion_32bit",
    "paged_lion_8bit",
    "paged_lion_32bit",
    "sgd",
    "sgd_momentum",
    "adafactor",
    "adagrad",
    "rmsprop",
)
MIXED_PRECISION = (None, "no", "bf16", "fp16")


@dataclass(frozen=True)
class _OptimizerModel:
    states: int  # full-size states per trainable element
    kind: str  # "param" (parameter dtype), "fp32", "8bit" or "factored"
    step_tensor: bool = False  # torch's optimizers keep a 0-dim fp32 step per parameter


def optimizer_name(optimizer: Any) -> str:
    """The static memory model's name of an optimizer object (`KNOWN_OPTIMIZERS`): torch's
    AdamW / Adam (foreach or fused), SGD, Adagrad, RMSprop, bitsandbytes' 8-bit and paged ones,
    transformers' Adafactor. Accelerate's wrapper is looked through."""
    opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    cls = type(opt).__name__.lower()
    defaults = getattr(opt, "defaults", {})
    if "8bit" in cls or "32bit" in cls:
        bits = "8bit" if "8bit" in cls else "32bit"
        base = "lion" if "lion" in cls else "adamw"
        return f"{'paged_' if 'paged' in cls else ''}{base}_{bits}"
    if cls in ("adamw", "adam"):
        return "adamw_torch_fused" if defaults.get("fused") else "adamw_torch"
    if cls == "sgd":
        return "sgd_momentum" if defaults.get("momentum") else "sgd"
    if cls in ("adafactor", "adagrad", "rmsprop", "lion"):
        return cls
    raise BudgetError(
        f"no static memory model for the optimizer {type(opt).__name__}: pass the closest of "
        f"{', '.join(KNOWN_OPTIMIZERS)} as optimizer='...'"
    )


def _optimizer_model(name: str) -> _OptimizerModel:
    n = name.lower().strip()
    one_state = any(k in n for k in ("lion", "rmsprop", "adagrad"))
    if "8bit" in n:
        return _OptimizerModel(1 if one_state else 3 if "ademamix" in n else 2, "8bit")
    if n == "sgd":
        return _OptimizerModel(0, "param")
    if n == "sgd_momentum":
        return _OptimizerModel(1, "param")
    if n == "adafactor":
        return _OptimizerModel(1, "factored")
    if n in ("adagrad", "rmsprop"):
        return _OptimizerModel(1, "param", step_tensor=True)
    if n == "lion":
        return _OptimizerModel(1, "param")
    if n.endswith("_32bit") and ("adamw" in n or "lion" in n):
        return _OptimizerModel(1 if one_state else 2, "fp32")
    if "4bit" not in n and (n.startswith("adamw_torch") or n in ("adamw", "adam")):
        return _OptimizerModel(2, "param", step_tensor=True)
    if n == "adamw_hf":
        return _OptimizerModel(2, "param")
    raise BudgetError(
        f"unknown optimizer {name!r} for the static memory model; known: "
        f"{', '.join(KNOWN_OPTIMIZERS)} (and any 'adamw_torch*' name except 4-bit ones, "
        "or '*8bit*')"
    )


@dataclass(frozen=True)
class StaticMemory:
    """Bytes per device that do not depend on the activation policy."""

    params: int
    grads: int
    optimizer: int
    master_weights: int
    num_params: int = 0
    num_trainable: int = 0
    note: str = ""
    buffers: int = 0  # model buffers (rotary tables, position ids), quantised weights' states
    optimizer_step: int = 0  # temporaries alive inside optimizer.step()
    comm: int = 0  # communication buffers held all step (DDP's gradient buckets)
    engine: EngineMemory | None = None  # FSDP2 / ZeRO-2 / ZeRO-3 per-moment rules (`engines`)
    # Input batches the run's data loader holds on the device beyond the step's own (the next
    # one, fetched ahead: `engine.context.SessionContext.count_batches_ahead`).
    batches_ahead: int = 0

    @property
    def total(self) -> int:
        """Parameters, gradients, optimizer states, master weights and communication buffers
        (what persists)."""
        return self.params + self.grads + self.optimizer + self.master_weights + self.comm

    @property
    def resident(self) -> int:
        """On the device all step long, gradients aside: parameters, buffers, states, masters,
        communication buffers and the loader's batches fetched ahead."""
        return (
            self.params
            + self.buffers
            + self.optimizer
            + self.master_weights
            + self.comm
            + self.batches_ahead
        )

    def describe(self) -> str:
        """A small table: one line per component, then the total."""
        rows = [
            ("parameters", self.params, f"{self.num_params:,} elements"),
            ("gradients", self.grads, f"{self.num_trainable:,} trainable"),
            ("optimizer states", self.optimizer, ""),
            ("master weights", self.master_weights, ""),
            ("comm buffers", self.comm, "DDP buckets / ZeRO-3 gradient partitions"),
        ]
        lines = [f"{'component':18s} {'bytes/device':>14s}  note"]
        lines += [f"{k:18s} {fmt_bytes(v):>14s}  {n}".rstrip() for k, v, n in rows]
        lines.append(f"{'total':18s} {fmt_bytes(self.total):>14s}  {self.note}".rstrip())
        return "\n".join(lines)


def _numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter, also when sharded: a ZeRO-3 partition keeps the count in
    `ds_numel`; an FSDP2 DTensor reports its global shape."""
    return int(getattr(p, "ds_numel", 0) or 0) or p.numel()


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    seen: set[tuple[str, int]] = set()
    out = []
    for p in model.parameters():
        # Tied weights share an address; DeepSpeed's ZeRO-1/2 parameters are views into one flat
        # buffer (one storage, distinct addresses). FSDP2: the local shard holds the data.
        local = p.to_local() if hasattr(p, "to_local") else p
        key = (str(p.device), local.data_ptr()) if local.numel() else ("", id(p))
        if key in seen:
            continue
        seen.add(key)
        out.append(p)
    return out


#: optimizer.step() temporaries on CPU, in units of the largest trainable parameter (see above).
_STEP_LARGEST_CPU = {"param": 2.5, "fp32": 3.5, "8bit": 6.5, "factored": 2.5}
#: The same for one flat tensor (DeepSpeed ZeRO-1/2's partition): AdamW's ``sqrt`` and division,
#: with no previous parameter's left alive beside them (measured per rank: exactly 2x).
_STEP_FLAT_CPU = {"param": 2.0}


#: Scalars an optimizer step allocates whatever the model (step counts, bias corrections).
_STEP_SCALARS = 1024


def _step_nbytes(
    name: str, opt: _OptimizerModel, largest: int, trainable: int, cuda: bool, flat: bool = False
) -> int:
    return _STEP_SCALARS + _step_temporaries(name, opt, largest, trainable, cuda, flat)


def _step_temporaries(
    name: str, opt: _OptimizerModel, largest: int, trainable: int, cuda: bool, flat: bool = False
) -> int:
    """Temporaries of one optimizer step; `flat`: the trainable parameters are one tensor."""
    n = name.lower()
    if n in ("sgd", "sgd_momentum"):
        return trainable if cuda else largest  # with weight decay: grad + wd * param
    if "fused" in n:
        return 0
    if cuda:
        return largest if opt.kind in ("8bit", "fp32", "factored") else trainable
    multiple = _STEP_FLAT_CPU.get(opt.kind) if flat else None
    return round((multiple or _STEP_LARGEST_CPU[opt.kind]) * largest)


def _quantised(p: torch.Tensor, opt: _OptimizerModel, fp32: set[int]) -> bool:
    """Whether an 8-bit optimizer keeps `p`'s states in 8 bits: large enough, and not one whose
    states were overridden to fp32 (ids in `fp32`)."""
    return opt.kind == "8bit" and _numel(p) >= BNB_MIN_8BIT_SIZE and id(p) not in fp32


def _state_nbytes(p: torch.Tensor, opt: _OptimizerModel, quantised: bool) -> int:
    """Bytes of `p`'s optimizer states (an 8-bit optimizer's: in fp32 unless `quantised`)."""
    n, e = _numel(p), p.element_size()
    step = 4 if opt.step_tensor else 0
    if opt.kind == "param":
        return opt.states * n * e + step
    if opt.kind == "fp32":
        return opt.states * n * 4 + step
    if opt.kind == "8bit":
        if not quantised:
            return opt.states * n * 4
        return opt.states * (n + 4 * math.ceil(n / BNB_BLOCK))
    # factored (Adafactor): fp32 row/col second moments for >= 2-D, full otherwise; RMS scalar
    shape = tuple(getattr(p, "ds_shape", None) or p.shape)  # ZeRO-3: the whole shape
    if len(shape) >= 2:
        rows = math.prod(shape[:-1])
        cols = math.prod(shape[:-2]) * shape[-1]
        return (rows + cols) * 4 + 4
    return n * 4 + 4


def estimate_static_memory(
    model: nn.Module,
    *,
    optimizer: str = "adamw_torch",
    mixed_precision: str | None = None,
    master_weights: bool = False,
    zero_stage: int = 0,
    fsdp: bool = False,
    world_size: int = 1,
    offload_optimizer: bool = False,
    fp32_embeddings: bool = False,
    ddp: bool = False,
    zero_buckets: int | None = None,
    rank: int | None = None,
) -> StaticMemory:
    """Predicted static bytes per device of training ``model`` (rules in the module docstring).

    Parameters, gradients, optimizer states, master weights and communication buffers: what does
    not depend on the activation policy, from the model alone.

    Args:
        model: the model as it trains (frozen parameters, e.g. a LoRA base model, have no
            gradients nor states).
        optimizer: the optimizer's name as ``TrainingArguments.optim`` gives it (one of
            `KNOWN_OPTIMIZERS`, any ``"adamw_torch*"`` name except 4-bit ones, or ``"*8bit*"``).
        mixed_precision: ``None`` / ``"no"``, ``"bf16"`` or ``"fp16"``.
        master_weights: fp32 copies of 16-bit parameters (DeepSpeed-style mixed precision; needs
            `mixed_precision` unless ZeRO-1/2).
        zero_stage: the DeepSpeed ZeRO stage (0-3) sharding states, gradients and parameters over
            `world_size`.
        fsdp: FSDP full shard over `world_size` (not with a ZeRO stage).
        world_size: the ranks sharing the model (>= 1).
        offload_optimizer: optimizer states and master weights are kept off the device.
        fp32_embeddings: 8-bit optimizers keep embedding states in fp32, as under the HF Trainer.
        ddp: replicated over ``world_size`` ranks by DDP, with its gradient buckets.
        zero_buckets: ZeRO-2's reduce-bucket elements.
        rank: that rank's engine rules (None: the worst rank's; `engines.engine_memory`).

    Returns:
        The `StaticMemory`: bytes per kind (``total`` is what persists all step), the optimizer
        step's temporaries and the sharding engine's per-moment rules.

    Raises:
        BudgetError: an unknown optimizer or mixed precision, or options that do not go together
            (``fsdp`` with a ZeRO stage, ``ddp`` with either, ``master_weights`` without mixed
            precision, a ZeRO stage outside 0-3, a `world_size` below 1).
    """
    opt = _optimizer_model(optimizer)
    if mixed_precision not in MIXED_PRECISION:
        raise BudgetError(
            f"mixed_precision must be one of {MIXED_PRECISION}, not {mixed_precision!r}"
        )
    if master_weights and mixed_precision in (None, "no") and zero_stage not in (1, 2):
        raise BudgetError("master_weights=True needs mixed_precision='bf16' or 'fp16'")
    if zero_stage not in (0, 1, 2, 3):
        raise BudgetError(f"zero_stage must be 0, 1, 2 or 3, not {zero_stage!r}")
    if fsdp and zero_stage:
        raise BudgetError("use either fsdp=True (full shard) or a ZeRO stage, not both")
    if ddp and (fsdp or zero_stage):
        raise BudgetError("ddp=True is plain data parallelism: not with fsdp or a ZeRO stage")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise BudgetError(f"world_size must be an int >= 1, not {world_size!r}")

    params = grads = states = master = largest = 0
    num = trainable = 0
    any_8bit = False
    fp32 = (
        {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        if fp32_embeddings and opt.kind == "8bit"
        else set()
    )
    for p in _unique_params(model):
        n, e = _numel(p), p.element_size()
        params += n * e
        num += n
        if not p.requires_grad:
            continue
        trainable += n
        grads += n * e
        largest = max(largest, n * e)
        quantised = _quantised(p, opt, fp32)
        states += _state_nbytes(p, opt, quantised)
        any_8bit |= quantised
        if master_weights and p.is_floating_point() and (e < 4 or zero_stage in (1, 2)):
            master += 4 * n
    if any_8bit:
        states += opt.states * BNB_QMAP_NBYTES

    def shard(nbytes: int, on: bool) -> int:
        return -(-nbytes // world_size) if on else nbytes

    stage = 3 if fsdp else zero_stage
    notes = [optimizer]
    if stage:
        notes.append(f"{'FSDP full shard' if fsdp else f'ZeRO-{stage}'} over {world_size}")
    if ddp:
        notes.append(f"DDP over {world_size}")
    if offload_optimizer:
        notes.append("optimizer offloaded")
    cuda = any(p.device.type == "cuda" for p in model.parameters())
    states, master = shard(states, stage >= 1), shard(master, stage >= 1)
    if zero_stage in (1, 2):  # DeepSpeed steps one flat fp32 partition, from a flat fp32 gradient
        part = shard(4 * trainable, True)
        fp32_copy = part if grads != 4 * trainable else 0  # of 16-bit gradients
        step = _step_nbytes(optimizer, opt, part, part, cuda, flat=True) + fp32_copy
    else:
        step = shard(_step_nbytes(optimizer, opt, largest, grads, cuda), stage >= 1)
    if offload_optimizer:
        states = master = step = 0
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # Quantised weights' states (bitsandbytes absmax / code tables / 8-bit row scales), each
    # storage once and none a parameter's (an 8-bit weight's ``CB`` is its own data).
    quantized = quantization_tensors(model)
    if quantized:  # (an FSDP2 DTensor parameter has no storage of its own to read)
        held = {(str(p.device), p.untyped_storage().data_ptr()) for p in model.parameters()}
        buffers += storage_nbytes(
            t for t in quantized if (str(t.device), t.untyped_storage().data_ptr()) not in held
        )
    grads = shard(grads, stage >= 2)
    comm = grads if ddp and world_size > 1 else 0
    if zero_stage == 3 and not offload_optimizer:  # the flat gradient-partition buffer
        comm, grads = grads, 0
    return StaticMemory(
        params=shard(params, stage >= 3),
        grads=grads,
        optimizer=states,
        master_weights=master,
        num_params=num,
        num_trainable=trainable,
        note=", ".join(notes),
        buffers=buffers,
        optimizer_step=step,
        comm=comm,
        engine=engine_memory(
            model,
            fsdp=fsdp,
            zero_stage=zero_stage,
            world_size=world_size,
            buckets=zero_buckets,
            rank=rank,
        ),
    )


def measured_static_memory(model: nn.Module, optimizer_obj: Any) -> int:
    """Real bytes of parameters, their gradients and every tensor in ``optimizer_obj.state``.

    Each storage counts once (tied weights, shared quantisation maps, views).
    """
    params = list(model.parameters())
    return storage_nbytes([*params, *(p.grad for p in params), *optimizer_tensors(optimizer_obj)])
