"""When rank 0 cannot solve (budget below static memory), every rank raises; none waits forever.

torchrun --standalone --nproc_per_node 2 leader_failure.py --out D
"""

from __future__ import annotations

import argparse

import torch.distributed as dist
from common import write

import adacc_hf
from adacc_hf import assets


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    model = assets.tiny_model("llama", seed=0)
    batch = assets.tiny_batch("llama", model)
    try:
        adacc_hf.prepare(model, 1024, batch)  # far below static memory
        error = None
    except Exception as e:
        error = {"type": type(e).__name__, "message": str(e)[:300]}
    write(args.out, "failure", {"error": error})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
