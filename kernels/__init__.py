"""Triton kernels of the adacc-hf codecs, bit-compatible with the torch references.

The references live in ``adacc_hf.codecs`` (``base.py`` fixes the arithmetic and the layouts);
``adacc_hf.codecs.dispatch`` decides per tensor whether a codec runs these kernels
(``ADACC_KERNELS=auto|triton|torch``). Three layers, each testable alone:

* one module per codec with the Triton kernels and host launch code: :mod:`.int4_naive`,
  :mod:`.int4_outlier`, :mod:`.int4_channel`, :mod:`.int4_asym` (all built on the shared INT4
  kernels of :mod:`.int4` (fused segment encoder, its device helpers in :mod:`.int4_tiles`),
  :mod:`.int4_quant` (column reductions, quantisers), :mod:`.int4_decode` and
  :mod:`.int4_select` (the outlier selection)), :mod:`.bitpack`, :mod:`.fp8`; functions take
  and return plain tensors ([rows, channels] inputs, payload tensors as in the references;
  decoders also write into a given ``out=``); :mod:`.selection` is the outlier selection rule
  in torch (the reference the kernel follows) and the buffer sizes both share;
* :mod:`.ops`: the same functions as ``torch.ops.adacc.*`` custom ops with fake
  implementations (traceable by ``torch.compile`` / ``make_fx``);
* the codec glue in ``adacc_hf.codecs.dispatch`` (``Encoded`` payloads <-> ops).

Passes over memory (``x`` = the activation, ``P`` = the payload):

=============  ================================================================  ===========
codec          encode                                                            decode
=============  ================================================================  ===========
int4_naive     1 read of x, 1 write of P (stats + quantise + pack fused)         1 + 1
int4_asym      1 read of x, 1 write (per-row min/max fused; rows wider than a      1 + 1
               register tile re-read once from cache)
int4_channel   2 reads of x (column absmax needs every row first), 1 write       1 + 1
int4_outlier   1 read + column sums fused; one selection launch (z-scores,       1 + 1
               threshold, top capacity, slot map); groups holding outliers       (gather via
               re-read and rewritten (gather of the exact values fused there)    the slot map)
bitpack        1 read, 1 write (float masks: per-program stats, then a           1 + 1
               one-program finaliser)
fp8_e4m3       1 read, 1 write (per-block absmax fused)                          1 + 1
=============  ================================================================  ===========

Launches per call: 1 (int4_naive, int4_asym, fp8, bool bitpack) or 2 (float bitpack) per
encode, int4_channel 3, int4_outlier 3 (odd groups 4); every decode 1
(``tests/kernels/test_kernel_launches.py`` pins them). Every launch goes through
:func:`._common.launch` (a CUDA tensor's launches run under ``torch.cuda.device`` of its device).
Encoders read inputs through their strides (no copy for transposed or sliced views); offsets are
64-bit (``tests/kernels/test_kernel_offsets.py``).

Odd layouts (an odd number of codes per row, so bytes straddle rows) use a statistics pass plus a
"flat" quantiser that walks the byte array (one more read). No kernel launch waits for the
device: payload sizes are fixed by the input shape, and inf / NaN inputs are encoded in place
(flagged segments and marker codes, ``adacc_hf.codecs.base``) rather than checked on the host.

Autotuning: every launch goes through a ``triton.autotune`` object (:class:`._common.Tuned`; the
config lists are built in one place, :func:`._common.configs`).

* Tuned: each kernel's tile constexprs (``BLOCK_R`` / ``BLOCK_C`` / ``BLOCK_W`` / ``BLOCK_H`` /
  ``BLOCK`` / ``BLOCK_P``), ``num_warps`` (1-16, by tile size) and, for kernels that loop,
  ``num_stages`` 1-3 (the others keep Triton's default, 3). GPU candidates cover 512 to 8192
  elements per program, pruned to what fits the shape (no tile wider than the padded extent; a
  segment tile still holds a whole segment, or a ``MAX_SEGMENT_WIDTH`` chunk of a wider one), with
  the old heuristic's choice first, so tuning never picks worse than it.
* Keyed: each launcher's *plan* (power-of-two buckets of the shape and the settings the heuristic
  reads) selects an autotuner; within it ``key`` is ``tune_key`` (an int argument holding the
  power-of-two bucket of each dimension, :func:`._common.size_class`) plus the constexpr flags,
  and Triton adds the tensors' dtypes. Shapes within a bucket share one tuning (training's
  varying sequence lengths do not retune); results are also cached on disk by Triton. A key's
  first launch benchmarks the candidates (a GPU sync, once); later launches are one launch each,
  without syncs.
* Interpreter (``TRITON_INTERPRET=1``): each plan's list is exactly the old heuristic's config.
  It still goes through the autotuner, but nothing is benchmarked: the interpreter ignores warps
  and stages, costs ~4 ms per program, and Triton's benchmarker needs a GPU.
* Invariance: payloads never depend on the config. Elementwise work and max / min / integer
  reductions are exact in any order; float sums, whose order follows the tile's layout and warps
  (``int4_outlier``'s column sums, the selection's statistics), keep the heuristic's tile and
  warps and tune only ``num_stages``. Buffers sized by the tiling take it from the plan (column
  partials' row blocks are fixed per plan; bitpack's statistics are sized for the config with the
  most programs and its finaliser reads the chosen config's count on the host). The tuner reruns
  kernels while benchmarking: every kernel writes a function of its inputs, except the
  selection's ticket counter, which is reset to zero before each run (``reset_to_zero``).
  ``tests/kernels/test_kernel_autotune.py`` runs every candidate tile of small shapes against the torch
  references.

Nothing here imports triton at import time: kernel modules are imported by the ops on first
use, which is when Triton decides between compiled kernels and its CPU interpreter
(``TRITON_INTERPRET=1``, only for tests).
"""

from ._triton import KernelUnavailableError, triton_available, triton_version

__all__ = ["KernelUnavailableError", "triton_available", "triton_version"]
