"""adacc-hf's benchmarks. Each is run as a script and puts the repository root on ``sys.path`` to
import this package; once it is imported the root comes off again, or the root's ``kernels/``
directory (installed as ``adacc_kernels``) would be found as Hugging Face's ``kernels`` package,
which bitsandbytes tries to import."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if sys.path and sys.path[-1] == _ROOT:  # appended by one of our scripts, not the user's own path
    sys.path.pop()
