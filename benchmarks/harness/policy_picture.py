"""Draw a per-op policy as a picture: ops (rows, in execution order) x blocks (columns).

Each cell is the action the block applies to the op's output: retain, compress (one shade per
codec), recompute, or no checkpointing at all (the whole block keeps what autograd saves). Row
labels give the op key, its layer type and output size; ops autograd saves are marked ``*``.

Drawn by the throughput suite for Adacc's policy at the main micro-batch, and from a saved policy
by ``python benchmarks/plot_policy.py adacc_policy.json policy.png [--title TEXT]``.
"""

from __future__ import annotations

from typing import Any

from adacc_hf import Policy

COLOURS: dict[str, str] = {
    "no checkpoint": "#d9d9d9",
    "retain": "#2ca02c",
    "recompute": "#ff7f0e",
    "compress:int4_outlier": "#1f77b4",
    "compress:int4_channel": "#6baed6",
    "compress:int4_asym": "#9467bd",
    "compress:int4_naive": "#17becf",
    "compress:bitpack": "#8c564b",
    "compress:fp8_e4m3": "#e377c2",
    "compress:other": "#08306b",
}


def _cell(kind: str) -> str:
    return kind if kind in COLOURS else "compress:other"


def policy_grid(policy: Policy, group: str) -> tuple[list[str], list[list[str]]]:
    """(row labels, cells[op][block]) of one group; cells name a `COLOURS` key."""
    g = policy.groups[group]
    labels = [
        f"{op.key}{' *' if op.saved else ''}  [{op.layer_type}, {op.nbytes / 2**20:.2f} MiB]"
        for op in g.ops
    ]
    cells: list[list[str]] = [[] for _ in g.ops]
    for v in g.block_variants():
        for i, op in enumerate(g.ops):
            if not v.checkpoint:
                cells[i].append("no checkpoint")
                continue
            a = v.action(op.key)
            cells[i].append(_cell(f"compress:{a.codec}" if a.kind == "compress" else a.kind))
    return labels, cells


def draw_policy(policy: Policy, path: str, title: str | None = None) -> str:
    """Write the picture of `policy` to `path` (PNG); returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    names = sorted(policy.groups)
    keys = list(COLOURS)
    grids = [policy_grid(policy, n) for n in names]
    rows = max(len(lbl) for lbl, _ in grids)
    fig, axes = plt.subplots(
        1,
        len(names),
        figsize=(5.5 * len(names) + 2.5, max(3.0, 0.16 * rows + 1.6)),
        squeeze=False,
    )
    used: set[str] = set()
    for ax, name, (labels, cells) in zip(axes[0], names, grids, strict=True):
        nblocks = len(cells[0]) if cells else 0
        data = [[keys.index(c) for c in row] for row in cells]
        used.update(c for row in cells for c in row)
        ax.imshow(
            data or [[0]],
            aspect="auto",
            cmap=ListedColormap([COLOURS[k] for k in keys]),
            vmin=-0.5,
            vmax=len(keys) - 0.5,
            interpolation="nearest",
        )
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=5.5, family="monospace")
        step = max(1, nblocks // 12)
        ax.set_xticks(range(0, nblocks, step))
        ax.set_xticklabels([str(i) for i in range(0, nblocks, step)], fontsize=7)
        ax.set_xlabel("block   (* = op output saved by autograd)")
        ax.set_title(f"group {name!r}: {nblocks} blocks x {len(labels)} ops", fontsize=8)
        ax.set_xticks([x - 0.5 for x in range(1, nblocks)], minor=True)
        ax.grid(which="minor", axis="x", color="white", linewidth=0.6)
        ax.tick_params(which="minor", length=0)
    handles = [Patch(color=COLOURS[k], label=k) for k in keys if k in used]
    fig.legend(handles=handles, loc="center right", fontsize=7, frameon=False)
    meta: dict[str, Any] = policy.metadata
    head = title
    if head is None:
        head = f"{policy.model_type}: {meta.get('source', 'policy')}"
        if "budget_nbytes" in meta:
            head += f", budget {meta['budget_nbytes'] / 2**20:.1f} MiB"
    fig.suptitle(head, fontsize=9, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 0.8, 0.96))
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
