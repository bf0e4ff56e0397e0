"""Batch shapes and their buckets: one plan per bucket, so the budget holds for every batch.

With dynamic padding every batch has another length. A batch's *shape key* is its micro-batch
size and its sequence lengths rounded up to a bucket edge (`schema.buckets.bucket_edge`, the
runtime's slot tables round with it too: multiples of 8 up to 64, then four edges per doubling: 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, ...: at most 25 % apart and
every power of two an edge; one length for decoder-only and encoder models, the encoder's and the
decoder's for encoder-decoder models), and whether its attention mask masks anything: attention
takes another path with padding than without (other ops), so the two get separate plans. A bucket
is planned at its edge, on the run's own batch padded up to it (pad tokens, labels -100, the
attention mask extended with 0 when the batch has padding and with 1 when it has none), so every
batch of the bucket holds no more than what was profiled.

Padding-free batches (TRL's ``padding_free`` / BFD packing, `DataCollatorWithFlattening`) are one
row of all the micro-batch's tokens, ``[1, total_tokens]``, with ``position_ids`` restarting at 0
at each sequence and no attention mask: their bucket is (1, total tokens bucketed), and they count
as masked when they hold more than one sequence (transformers then builds a block-diagonal mask
from the position ids). Their padding is one more sequence (positions 0, 1, ...; the varlen
boundaries ``cu_seq_lens_*``, ``max_length_*`` and ``seq_idx`` extended to match); a single
sequence is padded by continuing its positions, so it stays one sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import AdaccError
from ..schema.buckets import bucket_edge

#: Attention masks: whether one masks anything sets the attention path.
MASK_KEYS = ("attention_mask", "decoder_attention_mask")
#: Keys whose dimension 1 is the decoder's sequence in encoder-decoder models.
DECODER_KEYS = frozenset({"labels", "decoder_input_ids", "decoder_attention_mask"})
#: What a padded position holds, per batch key (others: 0).
PAD_VALUES = {
    "labels": -100,
    "attention_mask": 0,
    "decoder_attention_mask": 0,
    "token_type_ids": 0,
}

ShapeKey = tuple[int, ...]
#: Padding-free varlen boundaries (TRL's collator): sequence starts and the longest sequence.
CU_SEQ_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
MAX_LENGTH_KEYS = ("max_length_q", "max_length_k")


def _lengths(batch: Mapping[str, Any], encoder_decoder: bool) -> tuple[int, int]:
    """(micro-batch size, (encoder) sequence length, decoder sequence length or 0)."""
    size = enc = dec = 0
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor) or v.dim() < 2:
            continue
        size = max(size, v.shape[0])
        if encoder_decoder and k in DECODER_KEYS:
            dec = max(dec, v.shape[1])
        else:
            enc = max(enc, v.shape[1])
    return size, enc, dec


def has_padding(batch: Mapping[str, Any]) -> bool:
    """Whether an attention mask of `batch` masks a position (reads the mask: a device sync, as
    transformers' own mask preparation does)."""
    masks = [batch[k] for k in MASK_KEYS if isinstance(batch.get(k), torch.Tensor)]
    return any(not bool(m.all()) for m in masks)


def is_packed(batch: Mapping[str, Any]) -> bool:
    """Whether `batch` packs several sequences into a row without an attention mask (padding-free):
    its ``position_ids`` restart somewhere, as transformers' mask preparation detects (a device
    sync, as it does)."""
    pos = batch.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.dim() < 2 or pos.shape[-1] < 2:
        return False
    if any(isinstance(batch.get(k), torch.Tensor) for k in MASK_KEYS):
        return False  # a mask is given: transformers reads it, not the positions
    return bool((pos[..., 1:] - pos[..., :-1] != 1).any())


def shape_key(
    batch: Mapping[str, Any], encoder_decoder: bool, max_length: int | None = None
) -> ShapeKey:
    """(micro-batch size, bucketed length[, bucketed decoder length], masked?) of `batch`; masked:
    a padded position, or several sequences packed into a row."""
    size, enc, dec = _lengths(batch, encoder_decoder)
    key = (size, bucket_edge(enc, max_length))
    if encoder_decoder:
        key = (*key, bucket_edge(dec, max_length))
    return (*key, int(has_padding(batch) or is_packed(batch)))


def exact_key(batch: Mapping[str, Any]) -> ShapeKey:
    """A plain PyTorch model's bucket (`adapters.plain`): (rows, the most elements a row of one
    of its tensors holds, 0), exact. Its batches are never padded (an image's channels, a
    position table's length: padding a dimension of an arbitrary model's input may break it), so
    each shape is planned as it comes."""
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()]
    rows = max((v.shape[0] for v in tensors), default=0)
    per_row = max((v.numel() // max(1, v.shape[0]) for v in tensors), default=0)
    return (rows, per_row, 0)


def _positions_fill(v: torch.Tensor, n: int, masked: bool) -> torch.Tensor:
    """`n` more position ids for each row of `v`: a new sequence (0, 1, ...) in a masked bucket,
    else the row's own positions continued (one sequence stays one sequence)."""
    steps = torch.arange(n, device=v.device, dtype=v.dtype).expand(v.shape[0], n)
    return steps if masked else v[:, -1:] + 1 + steps


def padded(batch: Mapping[str, Any], key: ShapeKey, pad_token_id: int | None) -> dict[str, Any]:
    """`batch` padded on the right (dimension 1) up to the lengths of `key` (dimension 0 up to its
    micro-batch size, repeating the last row), for profiling at the bucket's edge; attention masks
    are extended with 0 only in a bucket of padded batches."""
    size, length, masked = key[0], key[1], bool(key[-1])
    dec_length = key[2] if len(key) > 3 else length
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor) or v.dim() < 2:
            out[k] = v
            continue
        target = dec_length if len(key) > 3 and k in DECODER_KEYS else length
        pad_value = PAD_VALUES.get(k, pad_token_id if "input_ids" in k and pad_token_id else 0)
        if k in MASK_KEYS and not masked:
            pad_value = 1  # the batch attends everywhere: so does its profile
        if v.shape[1] < target:
            n = target - v.shape[1]
            if k == "position_ids" and v.dim() == 2:
                fill = _positions_fill(v, n, masked)
            elif k == "seq_idx" and v.dim() == 2:  # padding-free: the padding's own sequence
                fill = (v[:, -1:] + int(masked)).expand(v.shape[0], n)
            else:
                fill = v.new_full((v.shape[0], n, *v.shape[2:]), pad_value)
            v = torch.cat([v, fill], dim=1)
        if v.shape[0] < size:
            v = torch.cat([v, v[-1:].expand(size - v.shape[0], *v.shape[1:])], dim=0)
        out[k] = v
    _pad_boundaries(batch, out, length, masked)
    return out


def _pad_boundaries(
    batch: Mapping[str, Any], out: dict[str, Any], length: int, masked: bool
) -> None:
    """Padding-free varlen boundaries of `out` (one row padded to `length`): the padding is one
    more sequence in a masked bucket, else the last sequence grows."""
    for k in CU_SEQ_KEYS:
        cu = batch.get(k)
        if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or not len(cu) or cu[-1] >= length:
            continue
        end = cu.new_tensor([length])
        out[k] = torch.cat([cu, end]) if masked else torch.cat([cu[:-1], end])
        longest = int((out[k][1:] - out[k][:-1]).max())
        for m in MAX_LENGTH_KEYS:
            if isinstance(batch.get(m), int) and m[-1] == k[-1]:
                out[m] = max(batch[m], longest)


def key_text(key: ShapeKey) -> str:
    """A bucket as users read it: ``4 x 128, padded``."""
    text = " x ".join(str(k) for k in key[:-1])
    return text + (", padded" if key[-1] else "")


def row_tokens(key: ShapeKey) -> int:
    """The tokens a row of a bucket's batch holds (the sum of its sequence lengths)."""
    return sum(key[1:-1])


def key_tokens(key: ShapeKey) -> int:
    """The tokens of a bucket's batch (batch x a row's tokens)."""
    return key[0] * row_tokens(key)


#: The rows and tokens per sequence of the *tiny* bucket later buckets' memory is interpolated
#: from (`profiler.derive`): the smallest bucket edge.
TINY = (1, 8)


def tiny_key(key: ShapeKey) -> ShapeKey:
    """The tiny bucket of `key`'s kind: one row of `TINY` tokens per sequence, the same masking."""
    return (TINY[0], *(TINY[1] for _ in key[1:-1]), key[-1])


def tiny_batch(batch: Mapping[str, Any], key: ShapeKey, pad_token_id: int | None) -> dict[str, Any]:
    """`batch` cut to its first row and first tokens, then padded to `key`'s tiny bucket: a masked
    bucket keeps its last position padded, so attention takes the masked path as in the run."""
    cut = TINY[1] - int(bool(key[-1]))
    out = {
        k: v[:1, :cut] if isinstance(v, torch.Tensor) and v.dim() >= 2 else v
        for k, v in batch.items()
    }
    return padded(out, tiny_key(key), pad_token_id)


def derivable(batch: Mapping[str, Any]) -> bool:
    """Whether a bucket of `batch` can take its memory from others: not a padding-free batch with
    varlen boundaries, which cutting to the tiny bucket would break."""
    return not any(k in batch for k in (*CU_SEQ_KEYS, *MAX_LENGTH_KEYS, "seq_idx"))


def rows(batch: Mapping[str, Any], n: int) -> dict[str, Any]:
    """`batch` with `n` rows: its first `n`, or all of them repeated cyclically up to `n`."""
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 1}
    if len(sizes) != 1:
        raise AdaccError(f"auto micro-batch: the batch's tensors disagree on rows ({sizes})")
    have = sizes.pop()
    index = torch.arange(n) % have
    out: dict[str, Any] = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            out[k] = v[:n] if n <= have else v[index.to(v.device)]
        else:
            out[k] = v
    if "labels" in batch and batch["labels"] is batch.get("input_ids"):
        out["labels"] = out["input_ids"]  # one storage, as the run passes it
    return out
