"""Draw a saved per-op policy as a picture: ops (rows, in execution order) x blocks (columns).

    python benchmarks/plot_policy.py adacc_policy.json policy.png [--title TEXT]

Colours and layout: `benchmarks.harness.policy_picture`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    # appended, not prepended: our kernels/ dir must not shadow HF's `kernels` package
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from adacc_hf import Policy
from benchmarks.harness.policy_picture import draw_policy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("policy", help="a saved policy JSON (Policy.save / adacc_policy.json)")
    p.add_argument("out", help="PNG to write")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    print(draw_policy(Policy.load(args.policy), args.out, args.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
