"""The per-block checkpoint that retains, compresses or recomputes each op's output.

One mechanism: transformers' per-layer checkpoint hook (`GradientCheckpointingLayer`) calls
`BlockRuntime`, which runs torch's non-reentrant checkpoint with two dispatch modes. In forward,
`_KeepMode` caches the output of every op the policy retains (as is) or compresses (encoded);
in backward's recompute, `_ReplayMode` hands cached outputs back (decoded) instead of running
those ops, and runs every other op again. Dropout RNG is replayed by the checkpoint.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from ..codecs import Codec, Encoded, get_codec, payload_finite
from ..errors import PolicyError
from ..schema import Action, Variant
from .ops import (
    OpKeyer,
    RegionTracker,
    detach_for_cache,
    is_keyed_now,
    is_mutable,
    is_random,
    mutated_args,
    storage_id,
)

logger = logging.getLogger("adacc_hf")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class _Packed:
    """An encoded op output and what decoding needs to rebuild it exactly in shape and layout."""

    __slots__ = ("codec", "enc", "stride")

    def __init__(self, codec: Codec, enc: Encoded, stride: tuple[int, ...]) -> None:
        self.codec, self.enc, self.stride = codec, enc, stride

    def nbytes(self) -> int:
        return self.enc.nbytes()

    def decode(self) -> torch.Tensor:
        x = self.codec.decode(self.enc)
        if x.stride() != self.stride:
            y = torch.empty_strided(x.shape, self.stride, dtype=x.dtype, device=x.device)
            y.copy_(x)
            x = y
        return x


def _nbytes(entry: Any) -> int:
    if isinstance(entry, _Packed):
        return entry.nbytes()
    if isinstance(entry, torch.Tensor):
        return entry.numel() * entry.element_size()
    if isinstance(entry, (tuple, list)):
        return sum(_nbytes(e) for e in entry)
    return 0


def _unpack(entry: Any) -> Any:
    return entry.decode() if isinstance(entry, _Packed) else entry


class BlockRuntime:
    """Runs one block under one variant of the policy; installed as the block's checkpoint fn."""

    def __init__(
        self,
        block: nn.Module,
        path: str,
        group: str,
        variant: Variant,
        known_ops: set[str],
        warned: set[str],
    ) -> None:
        self.block = block
        self.path = path
        self.group = group
        self.known_ops = known_ops  # ops the policy names (absent from `actions`: recompute)
        self.regions = RegionTracker(block)
        self.unknown: set[str] = set()
        self.fallbacks: set[str] = set()
        self._warned = warned  # shared by every block of one handle: one warning per op
        self.tracker: Any = None  # an evolution.OutlierTracker during tracking steps
        self.last_bytes: dict[str, int] = {}
        self.set_variant(variant)

    def set_variant(self, variant: Variant) -> None:
        self.actions: dict[str, Action] = dict(variant.actions)
        self._codecs: dict[Action, Codec] = {}
        self._bitpack = get_codec("bitpack")

    def codec(self, action: Action) -> Codec:
        c = self._codecs.get(action)
        if c is None:
            c = self._codecs[action] = get_codec(action.codec, **dict(action.params))
        return c

    def remove(self) -> None:
        self.regions.remove()

    def __call__(self, fn, *args):
        run = _Run(self)
        out = checkpoint(
            fn,
            *args,
            use_reentrant=False,
            context_fn=lambda: (_KeepMode(run), _ReplayMode(run)),
            preserve_rng_state=True,
        )
        # A retained output that is the block's own output costs nothing extra: the next block
        # (or the final norm) holds it anyway.
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel():
                key = run.kept_storages.get(storage_id(t))
                if key is not None:
                    self.last_bytes[key] -= t.untyped_storage().nbytes()
        return out

    # ---- forward-side helpers
    def encode(self, key: str, action: Action, out: Any) -> Any:
        if action.kind == "retain":
            return tree_map(detach_for_cache, out)
        codec = self.codec(action)

        def enc(t: torch.Tensor) -> Any:
            if t.dtype in _FLOATS:
                encoded = codec.encode(t)
                if not payload_finite(encoded):
                    # inf / NaN inputs (e.g. -inf attention masks) cannot be quantised: keep this
                    # output exact rather than corrupt the gradients.
                    self.note_fallback(key, codec.name)
                    return detach_for_cache(t)
                return _Packed(codec, encoded, t.stride())
            if t.dtype == torch.bool:
                return _Packed(self._bitpack, self._bitpack.encode(t), t.stride())
            return detach_for_cache(t)

        if isinstance(out, torch.Tensor):
            return enc(out)
        # Multi-output ops (e.g. native_layer_norm -> out, mean, rstd): only the main output is
        # compressed; the small statistics are kept exact.
        return type(out)([enc(out[0]), *(detach_for_cache(t) for t in out[1:])])

    def note_fallback(self, key: str, codec: str) -> None:
        self.fallbacks.add(key)
        if ("fallback", key) not in self._warned:
            self._warned.add(("fallback", key))
            logger.warning(
                "adacc: %s cannot encode op %s in block %s (non-finite values); kept exact",
                codec,
                key,
                self.path,
            )

    def note_unknown(self, key: str) -> None:
        self.unknown.add(key)
        if ("unknown", key) not in self._warned:
            self._warned.add(("unknown", key))
            logger.warning(
                "adacc: op %s in block %s is not in the policy; recomputing it (the policy was "
                "traced on another batch shape, mask or attention path)",
                key,
                self.path,
            )


class _Run:
    """One checkpointed forward of one block: its cache of kept outputs."""

    def __init__(self, rt: BlockRuntime) -> None:
        self.rt = rt
        self.store: dict[str, Any] = {}
        self.kept_storages: dict[int, str] = {}


class _KeepMode(TorchDispatchMode):
    def __init__(self, run: _Run) -> None:
        super().__init__()
        self.run = run

    def __enter__(self):
        self.run.rt.regions.reset()
        self.keyer = OpKeyer(self.run.rt.regions)
        self.run.rt.last_bytes = {}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        run = self.run
        if is_mutable(func):
            if run.kept_storages:
                for t in mutated_args(func, args, kwargs):
                    key = run.kept_storages.get(storage_id(t))
                    if key is not None:
                        raise PolicyError(
                            f"op {key} of block {run.rt.path} is kept by the policy but later "
                            f"mutated in place by {func}; it must be recomputed"
                        )
            return out
        if not is_keyed_now(func, args, kwargs):
            return out
        key, _, _ = self.keyer.key(func)
        action = run.rt.actions.get(key)
        tracker = run.rt.tracker
        if action is None or action.kind == "recompute" or is_random(func):
            if action is None and key not in run.rt.known_ops:
                run.rt.note_unknown(key)
            if tracker is not None:
                tracker.observe(run.rt.group, key, out)
            return out
        entry = run.rt.encode(key, action, out)
        if tracker is not None:
            tracker.observe(run.rt.group, key, out, entry)
        run.store[key] = entry
        run.rt.last_bytes[key] = _nbytes(entry)
        if action.kind == "retain":
            # A raw cached output must not change before backward. (An encoded one is a snapshot:
            # the replay re-applies any later in-place op to it, as forward did.)
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.numel():
                    run.kept_storages[storage_id(t)] = key
        return out


class _ReplayMode(TorchDispatchMode):
    def __init__(self, run: _Run) -> None:
        super().__init__()
        self.run = run

    def __enter__(self):
        self.run.rt.regions.reset()
        self.keyer = OpKeyer(self.run.rt.regions)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not is_mutable(func) and is_keyed_now(func, args, kwargs):
            key, _, _ = self.keyer.key(func)
            entry = self.run.store.pop(key, None)
            if entry is not None:
                return tree_map(_unpack, entry)
        return func(*args, **(kwargs or {}))
