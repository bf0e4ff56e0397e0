"""Linear + cross-entropy summed over tokens without materialising the [tokens x vocab] logits.

`chunked_linear_ce_sum(x, weight, bias, target)` is ``cross_entropy(x @ weight.T + bias, target,
reduction="sum")`` computed a chunk of rows at a time, forward and backward:

* torch >= 2.13: ``torch.nn.functional.linear_cross_entropy`` with ``options=`` and
  ``reduction="none"``: its chunked op saves only the inputs and recomputes each chunk's logits in
  backward. (Its ``"sum"`` / ``"mean"`` op instead computes the gradients during forward and holds
  the weight's ``[vocab x hidden]`` gradient until backward, twice that at the backward: measured
  on SmolLM2's head, 110 MiB held and 220 MiB at backward against 0 and 122 MiB.)
* older torch: `_ChunkedLinearCE`, the same scheme by hand: it saves the inputs and the per-row
  log-sum-exp and recomputes each chunk's logits in backward.

Logits are computed in the inputs' dtype and reduced in fp32 (``acc_dtype``), like HF's loss
which upcasts the logits before the cross-entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .timing import modelled_device

#: torch ships the maintained chunked path (2.13 and later).
HAS_TORCH_CHUNKED = hasattr(F, "linear_cross_entropy") and hasattr(
    torch.nn, "LinearCrossEntropyOptions"
)


#: A chunk's fp32 logits are at most this large (or the hidden states' size, if larger).
CHUNK_LOGITS_NBYTES = 8 * 2**20
#: On a GPU, up to this large (but a quarter of the whole logits at most): a chunk of a few MiB
#: makes the head a string of small kernels. Modelled on an H200 (`devices`), SmolLM2's step at
#: 16k tokens took 271 ms with 8 MiB chunks, 243 with 64 and 224 with 256 (HF full: 224); the
#: H200 itself had measured 265 ms with 8 MiB chunks.
GPU_CHUNK_LOGITS_NBYTES = 256 * 2**20


def default_chunk_rows(
    num_rows: int, hidden: int, vocab: int, device: torch.device | None = None
) -> int:
    """Rows per chunk: a power of two (at least 8) whose fp32 logits stay within
    max(`CHUNK_LOGITS_NBYTES`, the fp32 hidden states' bytes); on a GPU (`device` CUDA, or a
    modelled one) within max(that, min(`GPU_CHUNK_LOGITS_NBYTES`, a quarter of the logits))."""
    target = max(CHUNK_LOGITS_NBYTES, num_rows * hidden * 4)
    gpu = device is not None and device.type == "cuda"
    if gpu or modelled_device() is not None:
        target = max(target, min(GPU_CHUNK_LOGITS_NBYTES, num_rows * vocab))
    rows = 1 << max(3, (target // (4 * max(vocab, 1))).bit_length() - 1)
    return max(1, min(num_rows, rows))


class _ChunkedLinearCE(torch.autograd.Function):
    """Summed cross-entropy of ``x @ w.T + b``, chunk by chunk; backward recomputes each chunk's
    logits from the saved inputs and log-sum-exps (one ``[rows x vocab]`` chunk alive at a time)."""

    @staticmethod
    def forward(ctx, x, w, b, target, ignore_index, rows):  # type: ignore[override]
        n = x.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)
        for s in range(0, n, rows):
            logits = F.linear(x[s : s + rows], w, b).float()
            lse[s : s + rows] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[s : s + rows, None]).squeeze(1)
            total += ((lse[s : s + rows] - picked) * valid[s : s + rows]).sum()
            del logits
        ctx.save_for_backward(x, w, b if b is not None else torch.empty(0), safe, valid, lse)
        ctx.has_bias, ctx.rows = b is not None, rows
        return total

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, w, b, safe, valid, lse = ctx.saved_tensors
        b = b if ctx.has_bias else None
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = torch.empty_like(x) if need_x else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        gb = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if need_b else None
        rows = ctx.rows
        for s in range(0, x.shape[0], rows):
            xs = x[s : s + rows]
            p = F.linear(xs, w, b).float().sub_(lse[s : s + rows, None]).exp_()
            p.scatter_add_(1, safe[s : s + rows, None], p.new_full((p.shape[0], 1), -1.0))
            p.mul_((valid[s : s + rows] * grad)[:, None])
            if gx is not None:
                gx[s : s + rows] = (p.to(w.dtype) @ w).to(x.dtype)
            if gw is not None:
                gw.addmm_(p.t(), xs.float())
            if gb is not None:
                gb += p.sum(0)
            del p
        return (
            gx,
            gw.to(w.dtype) if gw is not None else None,
            gb.to(b.dtype) if gb is not None and b is not None else None,
            None,
            None,
            None,
        )


def chunked_linear_ce_sum(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_rows: int | None = None,
    use_torch: bool | None = None,
) -> torch.Tensor:
    """Sum over rows of ``cross_entropy(x @ weight.T + bias, target)``, rows whose target is
    `ignore_index` left out; fp32 scalar. `x`: ``[rows, hidden]``; `chunk_rows`: rows per chunk
    (default `default_chunk_rows`); `use_torch`: torch's op (default: where it exists)."""
    rows = chunk_rows or default_chunk_rows(x.shape[0], x.shape[1], weight.shape[0], x.device)
    if use_torch is None:
        use_torch = HAS_TORCH_CHUNKED
    if use_torch:
        opts = torch.nn.LinearCrossEntropyOptions(
            batch_chunk_size=rows,
            acc_dtype=torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None,
        )
        per_row = F.linear_cross_entropy(
            x,
            weight,
            target,
            linear_bias=bias,
            reduction="none",
            ignore_index=ignore_index,
            options=opts,
        )
        return per_row.float().sum()
    return _ChunkedLinearCE.apply(x, weight, bias, target, ignore_index, rows)
