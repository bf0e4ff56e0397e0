"""What a sharding engine adds to a step's moments, per device: parameters gathered for forward and
backward, unsharded gradients before their reduction, communication buffers. Rules read off the
engines' sources (torch 2.13 ``fully_shard``, DeepSpeed 0.19), checked per rank in
``tests/integrations/test_distributed.py``. ``S_j``: block j's parameters unsharded; ``R``: the rest; ``n``:
the world size.

FSDP2 (one ``fully_shard`` per block and one on the root, ``_fsdp_param_group.py``):

* the root's parameters are unsharded from the root's forward to the end of backward (the root
  does not reshard after forward);
* forward: block j's pre-forward all-gathers its group into one flat output and copies it out into
  unsharded parameters (``foreach_all_gather_copy_out``); the flat output is kept until the next
  group's copy-out (``comm_ctx.all_gather_state``, implicit forward prefetch), the unsharded
  parameters are freed at its post-forward: ``R + 2 S_j`` while block j runs, ``R + S_{j-1} +
  2 S_j`` at its all-gather (block 0: the root's flat output, ``R``, in place of ``S_{j-1}``);
* backward: the root's pre-backward all-gathers the last block's group (``_backward_prefetch``),
  kept as a flat output until that block's pre-backward; each block's pre-backward then copies
  out its own and prefetches the previous block's: ``R + S_j + S_{j-1}`` while block j runs, plus
  its unsharded gradients (``S_j``) and the previous reduce-scatter's input buffer
  (``reduce_scatter_max_input_buffers = 1``: ``S_{j+1}``, dropped at block j's post-backward);
  reduced gradients are ``1/n`` views of each reduce-scatter's output.

DeepSpeed ZeRO-3 (``partitioned_param_coordinator.py``, ``stage3.py``): a module's parameters are
released after its forward only if the trace does not reuse them within ``max_reuse_distance``
elements (DeepSpeed's default 1e9); a block's next use is its backward, after every later block's
forward and backward and the head: a block whose later parameters (twice, plus the rest) count
fewer elements stays gathered from its forward to its backward (else one block and a prefetch
bucket are). Backward releases a module's parameters after its backward (no later reuse). A
block's gradients are copied into the reduce bucket and scattered into the flat partition buffer
(``grad_partitions_flat_buffer``, counted in ``StaticMemory.comm``): the unsharded gradients alive
are the running block's only.

DeepSpeed ZeRO-2 (``stage_1_and_2.py``): at the first gradient of backward it allocates its
reduce buckets (``reduce_bucket_size`` elements, twice with ``overlap_comm``, when
``contiguous_gradients``), held to the step's end; each gradient is copied into a bucket (its own
storage freed), or, larger than a bucket, reduced alone at the next flush; at its first flush of a
gradient it owns, a rank allocates its whole gradient partition (``1/n`` of every gradient,
``grads_in_partition``) and copies its share in; the rest is freed. The last rank owns the last
parameters, reduced first: its partition is there from the head's backward on (after the logits'
gradient), so for the worst rank (what a plan every rank shares must fit) every block's backward
holds the buckets and the whole partition in place of the gradients of the blocks after it; rank
r's partition comes at the backward of the last block it owns a parameter of (`_last_owned`). The
head holds the buckets; the embeddings' backward (after the first block) the partition, the
buckets and the gradients outside the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class EngineMemory:
    """A sharding engine's gathered parameters and gradient handling, per device."""

    kind: str  # "fsdp2", "zero3" or "zero2"
    world_size: int
    root: int = 0  # parameters outside the blocks, unsharded (bytes)
    blocks: tuple[int, ...] = ()  # each block's parameters unsharded, in forward order
    kept: bool = False  # ZeRO-3: blocks stay gathered from their forward to their backward
    buckets: int = 0  # ZeRO-2: reduce buckets (bytes), from backward's first gradient on
    partition: int = 0  # ZeRO-2: a rank's whole gradient partition (bytes)
    owned: int = -1  # ZeRO-2: the partition is there from this block's backward on (-1: the tail)


@dataclass
class EngineExtras:
    """Bytes the engine adds to each moment of `solver.step.step_peak` (lists: per block)."""

    forward: list[int] = field(default_factory=list)  # while block j runs
    forward_floor: list[int] = field(default_factory=list)  # at block j's all-gather, above that
    loss: int = 0
    head: int = 0
    head_floor: int = 0  # the last block's prefetch all-gather, above `head`
    backward: list[int] = field(default_factory=list)
    tail: int = 0


def _unsharded_nbytes(params: list[nn.Parameter]) -> int:
    """Whole parameters' bytes (ZeRO-3 partitions count `ds_numel`, FSDP2 DTensors their global
    shape); each parameter once."""
    seen: set[int] = set()
    total = 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += (int(getattr(p, "ds_numel", 0) or 0) or p.numel()) * p.element_size()
    return total


def engine_memory(
    model: nn.Module,
    *,
    fsdp: bool,
    zero_stage: int,
    world_size: int,
    buckets: int | None = None,
    rank: int | None = None,
) -> EngineMemory | None:
    """The engine rules' inputs read off `model` (None: not sharded over several ranks, or a model
    whose blocks the adapters do not find). `buckets`: ZeRO-2's reduce-bucket elements (None:
    "auto", ``hidden_size**2`` as the HF Trainer and Accelerate fill it in, counted twice as with
    ``overlap_comm``). `rank`: ZeRO-2's rules for that rank (None: the worst one, what a plan
    shared by every rank must fit)."""
    if world_size < 2 or not (fsdp or zero_stage >= 2):
        return None
    from ..adapters import get_adapter

    try:
        found = get_adapter(model).find_blocks(model)
    except Exception:  # no adapter: no block structure to apply the rules to
        return None
    if not found:
        return None
    blocks = tuple(_unsharded_nbytes(list(b.parameters())) for _, b in found)
    root = _unsharded_nbytes(list(model.parameters())) - sum(blocks)
    if fsdp:
        return EngineMemory("fsdp2", world_size, root, blocks)
    if zero_stage == 2:
        trainable = [p for p in model.parameters() if p.requires_grad]
        size = trainable[0].element_size() if trainable else 4
        if buckets is None:
            hidden = int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0)
            buckets = 2 * hidden * hidden
        grads = _unsharded_nbytes(trainable)
        owned = len(blocks) - 1 if rank is None else _last_owned(model, found, rank, world_size)
        return EngineMemory(
            "zero2", world_size, root, blocks, buckets=buckets * size,
            partition=-(-grads // world_size), owned=owned,
        )  # fmt: skip
    size = next(model.parameters()).element_size()
    # The first block's reuse is the farthest: every later block twice, and the rest, in between.
    walked = (2 * sum(blocks[1:]) + root) // size
    return EngineMemory("zero3", world_size, root, blocks, walked < _reuse_distance())


def _last_owned(model: nn.Module, found: list, rank: int, world_size: int) -> int:
    """ZeRO-2: the last block (forward order) with a trainable parameter in `rank`'s share of the
    flat gradients (parameters in `model.parameters()` order, split in `world_size` equal parts;
    DeepSpeed's, for one parameter group); the last block where `rank` owns a parameter after
    every block's (the final norm, an untied LM head: reduced first); -1 where it owns only the
    embeddings (reduced after the first block)."""
    block_of = {id(p): j for j, (_, b) in enumerate(found) for p in b.parameters()}
    trainable = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    share = -(-sum(p.numel() for p in trainable) // world_size)
    lo, hi, at, owned, seen_block = rank * share, (rank + 1) * share, 0, -1, False
    for p in trainable:
        j = block_of.get(id(p))
        seen_block |= j is not None
        if at < hi and at + p.numel() > lo:  # p overlaps the rank's share
            after_blocks = j is None and seen_block
            owned = max(owned, len(found) - 1 if after_blocks else (-1 if j is None else j))
        at += p.numel()
    return owned


def _reuse_distance() -> int:
    """DeepSpeed's default ``stage3_max_reuse_distance`` (elements)."""
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    except ImportError:  # pragma: no cover - DeepSpeed absent: its documented default
        return 1_000_000_000
    return int(DeepSpeedZeroConfig().max_reuse_distance)


def engine_extras(
    engine: EngineMemory | None, n_blocks: int, grads: list[int], unsharded: int
) -> EngineExtras:
    """Per-moment bytes of the module docstring's rules, for `n_blocks` blocks; `grads`: the
    unsharded gradients the timeline counts at each block's backward start (those of later blocks
    and outside the blocks); `unsharded`: every trainable parameter's."""
    if engine is None:
        return EngineExtras([0] * n_blocks, [0] * n_blocks, backward=[0] * n_blocks)
    s = list(engine.blocks) if len(engine.blocks) == n_blocks else [max(engine.blocks)] * n_blocks
    r, n, last = engine.root, engine.world_size, n_blocks - 1
    later = [sum(s[j + 1 :]) for j in range(n_blocks)]  # later blocks' unsharded gradients
    if engine.kind == "fsdp2":
        return EngineExtras(
            forward=[r + 2 * s[j] for j in range(n_blocks)],
            forward_floor=[s[j - 1] if j else r for j in range(n_blocks)],
            loss=r,  # the last flat output, freed at the root's post-forward: the loss's profile
            head=r + s[last],
            head_floor=s[last],  # gloo copies the flat output once while it all-gathers
            backward=[
                r
                + 2 * s[j]
                + (s[j - 1] if j else 0)
                + (s[j + 1] if j < last else 0)
                - later[j] * (n - 1) // n
                for j in range(n_blocks)
            ],
            tail=r + s[0] - sum(s) * (n - 1) // n,
        )
    if engine.kind == "zero3":
        if engine.kept:
            gathered = [r + sum(s[: j + 1]) for j in range(n_blocks)]
        else:
            gathered = [r + s[j] + (s[j + 1] if j < last else 0) for j in range(n_blocks)]
        return EngineExtras(
            forward=gathered,
            forward_floor=[0] * n_blocks,
            loss=gathered[last],
            head=gathered[last],
            backward=[gathered[j] + s[j] - later[j] for j in range(n_blocks)],
            tail=r - sum(s),
        )
    # zero2: buckets, and the whole partition (once allocated) in place of the reduced gradients
    b, p = engine.buckets, engine.partition
    g = grads or [0] * n_blocks
    return EngineExtras(
        forward=[0] * n_blocks,
        forward_floor=[0] * n_blocks,
        head=b,
        backward=[b + (p if j <= engine.owned else 0) - g[j] for j in range(n_blocks)],
        tail=b + p - max(0, unsharded - r),
    )
