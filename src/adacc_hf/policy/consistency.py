"""One rule keeps compressed gradients true: no lossy input beside an exact saved statistic.

Some ops save statistics of their inputs for their backward: fused attention (SDPA flash /
efficient / CPU flash, cuDNN) saves its output and log-sum-exp and re-derives the probabilities
as ``exp(q k^T scale - lse)``; layer / group / batch / fused RMS norms save mean and rstd. If such
an op's outputs are kept exact (retained) while its inputs reach backward altered (compressed by
a lossy codec, or recomputed from an altered input), its backward mixes the two: with real
weights' large attention logits an INT4 error of a fraction of a unit in ``q k^T`` becomes a factor
``e^delta`` in "probabilities" that no longer sum to one (measured on the pretrained SmolLM2-135M:
relative gradient error 7.8 with only Q / K / V compressed and the fused attention retained, 0.33
with it recomputed from the decoded inputs). Its own output compressed beside its exact lse
breaks the same way (0.25-0.63). Hence:

* a *statistic op* (`keeps_statistics`) is never compressed lossily;
* in a checkpointed block, a statistic op that runs after a lossily compressed op is recomputed
  (its backward then sees statistics of the very inputs it gets).

"After" is by position in the block, which over-approximates "depends on": every op before a
block's attention or norm feeds it in the transformer blocks we support, and the rule can only
recompute more than needed, never less. One home: the policy builders, `Policy.repair`, the solver
(`solver.milp`, as constraints) and the runtime's checks all ask here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..codecs import get_codec
from ..schema import RECOMPUTE, Action, OpSpec

__all__ = ["STATISTIC_ATEN", "conflicts", "keeps_statistics", "lossy", "repair_actions"]

#: Op overloads (substrings of ``OpSpec.aten``) whose backward re-derives values from statistics of
#: their inputs saved beside them.
STATISTIC_ATEN = (
    "scaled_dot_product",  # every SDPA backend: flash, efficient, cuDNN, CPU flash
    "flash_attn",
    "efficient_attention",
    "cudnn_attention",
    "native_layer_norm",
    "native_group_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_fused_rms_norm",
)


def keeps_statistics(op: OpSpec) -> bool:
    """Whether `op`'s backward uses statistics of its inputs saved beside its output."""
    return op.layer_type == "attn_fused" or any(s in op.aten for s in STATISTIC_ATEN)


def lossy(action: Action) -> bool:
    """A compress (or offload) action whose codec does not give back exactly what it was
    given."""
    return action.codec is not None and not get_codec(action.codec, **action.codec_kwargs).lossless


def conflicts(
    ops: Sequence[OpSpec], actions: Mapping[str, Action], checkpoint: bool = True
) -> list[str]:
    """Keys of the statistic ops the rule above must recompute in this action table (ops not in
    `actions` are recomputed)."""
    if not checkpoint:
        return []
    bad, tainted = [], False
    for op in ops:
        act = actions.get(op.key, RECOMPUTE)
        if keeps_statistics(op) and act.kind != "recompute" and (tainted or lossy(act)):
            bad.append(op.key)
        tainted = tainted or lossy(act)
    return bad


def repair_actions(
    ops: Sequence[OpSpec], actions: Mapping[str, Action], checkpoint: bool = True
) -> tuple[dict[str, Action], list[str]]:
    """`actions` with every conflicting statistic op recomputed, and the keys it changed."""
    bad = conflicts(ops, actions, checkpoint)
    fixed = dict(actions)
    for key in bad:
        fixed[key] = RECOMPUTE
    return fixed, bad
