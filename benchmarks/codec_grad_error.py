"""Gradient error of each codec on the tiny random-init family models.

For each family and codec: compress every op whose layer type defaults to that codec (everything
else recomputed), run one seeded forward/backward, and report ||g - g_ref|| / ||g_ref|| over all
parameters against the unpatched model. Forward outputs are checked identical.

    python benchmarks/codec_grad_error.py
"""

from __future__ import annotations

import sys

import torch

from adacc_hf import Action, apply_adacc, assets, uniform_policy

CODECS = ("int4_outlier", "int4_channel", "int4_asym", "bitpack")


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    out = model(**batch)
    out.loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out.logits.detach(), grads


def main() -> int:
    print(f"{'family':7s} " + " ".join(f"{c + ' (ops)':>20s}" for c in (*CODECS, "all")))
    for family in assets.SUPPORTED_FAMILIES:
        model = assets.tiny_model(family)
        batch = assets.tiny_batch(family, model)
        ref_logits, ref = _step(model, batch)
        cells = []
        for codec in (*CODECS, "all"):
            policy = uniform_policy(model, "compress", batch)
            n = 0
            for g in policy.groups.values():
                acts = g.variants[0].actions
                for k, a in acts.items():
                    if a.kind == "compress" and (codec == "all" or a.codec == codec):
                        n += 1
                    else:
                        acts[k] = Action.recompute()
            with apply_adacc(model, policy):
                logits, grads = _step(model, batch)
            assert torch.equal(logits, ref_logits)
            err = ((grads - ref).norm() / ref.norm()).item()
            cells.append(f"{err:14.4f} ({n:3d})" if n else f"{'-':>14s} (  0)")
        print(f"{family:7s} " + " ".join(f"{c:>20s}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
