"""A GPU check in sections: each on its share of one time limit, its result (or its error)
recorded and the JSON written after every section, so a run the device's limit cuts short still
returns what it measured."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .env import Deadline
from .report import write_json


def run_sections(
    names: Sequence[str],
    shares_s: Mapping[str, float],
    limit_s: float,
    run: Callable[[str, Deadline], dict[str, Any]],
    out: dict[str, Any],
    path: Path,
    *,
    after: Callable[[str, dict[str, Any]], None] | None = None,
) -> Deadline:
    """Run each section of `names` with `run(name, share)`: `share` is a `Deadline` at the end
    of that section's share of `limit_s` (shares in `shares_s` are scaled to it; a section may
    use what earlier ones left). A section that raises is recorded as an error and the next one
    runs; ``out["sections"][name]`` gets each result, `after(name, result)` runs, and `path` is
    written. Returns the whole run's deadline (its elapsed time)."""
    import torch

    deadline = Deadline(limit_s)
    scale = limit_s / sum(shares_s.values())
    out.setdefault("sections", {})
    spent = 0.0
    for name in names:
        spent += shares_s[name] * scale
        share = Deadline(max(0.0, spent - deadline.elapsed()))
        print(f"== {name} ({deadline}; until {spent:.0f} s)", flush=True)
        try:
            res = run(name, share)
        except Exception as e:  # recorded; the next section still runs
            traceback.print_exc()
            res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        res["seconds_at_end"] = deadline.elapsed()
        out["sections"][name] = res
        if after is not None:
            after(name, res)
        write_json(path, out)
    return deadline
