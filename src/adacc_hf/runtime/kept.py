"""What the runtime keeps of an op's output between forward and backward, and how replay gets
the output back.

An `Entry` holds an op's outputs raw (retain), encoded (compress: the main output with the slot's
codec, bool outputs bit-packed, small statistics such as layer norm's mean and rstd exact) or,
for ``native_dropout``, only its bit-packed mask (replay rebuilds the output from the input and
the mask, bit for bit); an offloaded slot parks all of it in host memory (`offload`) until
replay. Raw tensors remember their version counter: a kept output mutated in place afterwards is
an error, never a silent wrong gradient. Decoded outputs get the strides the
op's output had, so the ops after them take the same paths as in forward.
"""

from __future__ import annotations

from typing import Any

import torch

from ..codecs import Codec, Encoded, get_codec
from ..errors import PolicyError
from .offload import Frame, fetch_tree, park_tree
from .ops import detach_for_cache, mask_of
from .slots import MASK_ONLY, RAW, Slot

_BITPACK = get_codec("bitpack")


class Entry:
    """A kept op output: raw, encoded, or only its mask; plus what replay needs."""

    __slots__ = ("enc", "frame", "nbytes", "rng", "slot", "strides", "value", "versions")

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.value: list[Any] = []  # per output: the raw value, or None where encoded
        self.enc: list[Encoded | None] = []
        self.strides: list[tuple[int, ...] | None] = []  # of encoded outputs
        # (generator, state) after the op; for a filled tensor, one per fill (None: no RNG)
        self.rng: list[Any] = []
        self.versions: list[tuple[torch.Tensor, int]] = []  # raw tensors: no later mutation
        self.nbytes = 0
        self.frame: Frame | None = None  # where an offloaded entry's tensors are parked


def _outputs(out: Any) -> tuple | list:
    return out if isinstance(out, (tuple, list)) else (out,)


def packed_codec(i: int, t: Any, codec: Codec | None, bitpack: Codec) -> Codec | None:
    """How a compressed (packed) entry stores output `i` of its op: bool outputs bit-packed, the
    first output with the slot's `codec`, the rest (small statistics such as layer norm's mean
    and rstd, attention's log-sum-exp) raw (None)."""
    if not isinstance(t, torch.Tensor):
        return None
    c = bitpack if t.dtype == torch.bool else codec if i == 0 else None
    return c if c is not None and t.dtype in c.dtypes else None


def side_nbytes(out: Any) -> int:
    """Bytes a compressed (packed) entry of `out` holds besides its first output's payload: what
    compressing the op keeps on top of the codec's size (`OpSpec.side_nbytes`)."""
    total = 0
    for i, t in enumerate(_outputs(out)):
        if i == 0 or not isinstance(t, torch.Tensor):
            continue
        c = packed_codec(i, t, None, _BITPACK)
        total += c.predict_nbytes(t.shape, t.dtype) if c else t.numel() * t.element_size()
    return total


def keep(rt: Any, slot: Slot, out: Any) -> Entry:
    """Snapshot ``out`` the way ``slot`` says: raw, encoded (the main output with the slot's
    codec, bool outputs bit-packed, small statistics exact), or only its mask (an offloaded
    slot's snapshot then goes to `park`)."""
    e = Entry(slot)
    if slot.store == MASK_ONLY:
        e.enc = [rt.bitpack.encode(mask_of(out))]
        e.nbytes = e.enc[0].nbytes()
    else:
        _snapshot(rt, slot, out, e)
    return e


def _snapshot(rt: Any, slot: Slot, out: Any, e: Entry) -> None:
    packed = slot.store != RAW
    for i, t in enumerate(_outputs(out)):
        codec = packed_codec(i, t, slot.codec, rt.bitpack) if packed else None
        if codec is not None:
            enc = codec.encode(t)
            e.enc.append(enc)
            e.strides.append(t.stride())
            e.value.append(None)
            e.nbytes += enc.nbytes()
            continue
        v = detach_for_cache(t)
        e.enc.append(None)
        e.strides.append(None)
        e.value.append(v)
        if isinstance(v, torch.Tensor):
            e.versions.append((v, v._version))
            e.nbytes += v.numel() * v.element_size()


def park(host: Any, frame: Frame, e: Entry) -> None:
    """Move an entry's tensors to host memory in `frame` (a copy of each, taken now: no version
    to check); ``nbytes`` is then what stays on the device (what the host cap refused)."""
    e.versions = []
    e.value = [park_tree(host, frame, v) for v in e.value]
    e.enc = [park_tree(host, frame, c) for c in e.enc]
    e.nbytes = sum(_device_nbytes(v) for v in e.value) + sum(
        _device_nbytes(c) for c in e.enc if c is not None
    )
    e.frame = frame


def _device_nbytes(v: Any) -> int:
    """Bytes of `v` still on the device after parking (tensors the host cap refused)."""
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    return v.nbytes() if isinstance(v, Encoded) else 0


def _fetch(host: Any, e: Entry, discard: bool = False) -> None:
    e.value = [fetch_tree(host, e.frame, v, discard) for v in e.value]
    e.enc = [fetch_tree(host, e.frame, c, discard) for c in e.enc]


def release(rt: Any, e: Entry) -> None:
    """A dropped entry gives its parked tensors' host buffers back (nothing comes back)."""
    if e.frame is not None:
        _fetch(rt.host, e, discard=True)
        e.frame = None


def unpack(rt: Any, e: Entry, args: tuple) -> Any:
    """The op's output rebuilt from a kept entry (once, in replay)."""
    slot = e.slot
    if e.frame is not None:
        _fetch(rt.host, e)
    if slot.random and e.rng and e.rng[0] is not None:
        gen, state = e.rng[0]
        gen.set_state(state)  # as forward left it after this op
    if slot.store == MASK_ONLY:  # native_dropout: the output rebuilt from its input and mask
        mask = rt.bitpack.decode(e.enc[0])
        p = float(args[1])
        scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
        return torch.ops.aten.native_dropout_backward(args[0], mask, scale), mask
    for t, v in e.versions:
        if t._version != v:
            raise PolicyError(
                f"op {slot.key} is kept by the policy but was mutated in place after it ran; it "
                "must be recomputed"
            )
    vals = [
        v if enc is None else _decode(rt.codec_of(enc.codec), enc, stride)
        for v, enc, stride in zip(e.value, e.enc, e.strides, strict=True)
    ]
    return vals[0] if slot.single else tuple(vals)


def _decode(codec: Codec, enc: Encoded, stride: tuple[int, ...]) -> torch.Tensor:
    """Decoded with the strides the op's output had: ops downstream (``.contiguous()``,
    ``reshape``) must take the same paths as in forward. Codecs decode dense layouts in memory
    order with the right strides already; only exotic layouts (last dim not innermost,
    overlapping) need a restriding copy."""
    x = codec.decode(enc)
    if x.stride() == stride or x.dim() == 0:
        return x
    y = torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device)
    return y.copy_(x)


def generator_state_nbytes(device_type: str) -> int:
    """Bytes one generator state held for replay takes on a `device_type` device (the runtime's
    forward mode stores one per random op or random fill it keeps; `unpack` restores it): a CPU
    generator's state is a CPU tensor (5,056 bytes); a CUDA generator's is a host tensor, off the
    device."""
    return torch.default_generator.get_state().nbytes if device_type == "cpu" else 0
