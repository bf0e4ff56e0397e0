"""Figures of the results JSONs (matplotlib, Agg backend).

`throughput_plots`: tokens/s and step peak against micro-batch size per model (hollow markers: over
the budget), and a summary of ratios to HF full checkpointing and largest micro-batches.
`loss_curves`: an accuracy suite's train loss, held-out loss, and held-out loss against the
baseline, per strategy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .report import MiB, main_row
from .strategies import MAIN, REGISTRY, label


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_plots(out: Mapping[str, Any], results: Path, tag: str) -> list[str]:
    """Write the three throughput figures of `out` into `results`; returns their file names."""
    models = [m for m, r in out["models"].items() if r.get("sweep")]
    if not models:
        return []
    title = f"{out['device']}; hollow markers: over the budget ({tag})"
    figs = {
        f"throughput-vs-batch-{tag}.png": _against_batch(
            out, models, "tokens_per_s", "tokens / s", 1.0, title
        ),
        f"memory-vs-batch-{tag}.png": _against_batch(
            out, models, "peak_nbytes", "step peak (MiB)", MiB, title, budget_line=True
        ),
        f"summary-{tag}.png": _summary(out, models),
    }
    return [_save(fig, results / name) for name, fig in figs.items()]


def _save(fig: Any, path: Path) -> str:
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path.name


def _colours() -> dict[str, Any]:
    return dict(zip(REGISTRY, _pyplot().get_cmap("tab10").colors, strict=False))


def _against_batch(
    out: Mapping[str, Any],
    models: list[str],
    key: str,
    ylabel: str,
    scale: float,
    title: str,
    *,
    budget_line: bool = False,
) -> Any:
    """`key` of every strategy against micro-batch size, one panel per model."""
    plt, colours = _pyplot(), _colours()
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        res = out["models"][m]
        for n in MAIN:
            pts = [
                (row["batch_size"], r[key] / scale, bool(r.get("fits")))
                for row in res["sweep"]
                if (r := row["strategies"].get(n)) is not None and r.get(key) is not None
            ]
            if not pts:
                continue
            xs, ys, _ = zip(*pts, strict=True)
            ax.plot(xs, ys, "-", color=colours[n], label=label(n), alpha=0.8)
            for fit, style in (
                (True, {"color": colours[n], "s": 18}),
                (False, _hollow(colours[n])),
            ):
                sel = [(x, y) for x, y, f in pts if f == fit]
                if sel:
                    ax.scatter(*zip(*sel, strict=True), **style)
        if budget_line:
            ax.axhline(res["budget_nbytes"] / scale, color="k", ls="--", lw=1, label="budget")
        ax.set_xscale("log", base=2)
        sizes = [row["batch_size"] for row in res["sweep"]]
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.set_xlabel("micro-batch size")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{m} (seq {res['seq_len']}, {res['dtype'].removeprefix('torch.')})")
    axes[0][0].legend(fontsize=6.5)
    fig.suptitle(title, fontsize=9, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def _hollow(colour: Any) -> dict[str, Any]:
    return {"facecolors": "none", "edgecolors": colour, "s": 30}


def _summary(out: Mapping[str, Any], models: list[str]) -> Any:
    """Per model: tokens/s relative to HF full checkpointing at the main batch (top) and the
    largest micro-batch within the budget (bottom)."""
    plt, colours = _pyplot(), _colours()
    fig, axes = plt.subplots(2, len(models), figsize=(5.2 * len(models), 6.5), squeeze=False)
    for j, m in enumerate(models):
        res = out["models"][m]
        row = main_row(res)
        ns = [n for n in MAIN if row and n in row["strategies"]]
        vals = [row["strategies"][n].get("ratio_vs_hf_full") or 0.0 for n in ns] if row else []
        _bars(axes[0][j], ns, vals, colours)
        axes[0][j].axvline(1.0, color="k", lw=0.8)
        axes[0][j].set_xlabel("tokens/s relative to HF full checkpointing")
        axes[0][j].set_title(
            f"{m}: batch {res['main_batch']}, budget {res['budget_nbytes'] / MiB:.0f} MiB"
        )
        mb = res.get("max_batch", {})
        ns = [n for n in MAIN if n in mb]
        _bars(axes[1][j], ns, [mb[n]["peak"] for n in ns], colours)
        axes[1][j].set_xlabel("largest micro-batch within the budget")
    fig.tight_layout()
    return fig


def _bars(ax: Any, names: list[str], values: list[float], colours: Mapping[str, Any]) -> None:
    ax.barh(range(len(names)), values, color=[colours[n] for n in names])
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([label(n) for n in names], fontsize=7)
    ax.invert_yaxis()


def loss_curves(res: Mapping[str, Any], path: Path) -> str:
    """Train loss, held-out loss, and held-out loss relative to the baseline, per strategy."""
    plt, colours = _pyplot(), _colours()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    base = dict(res["runs"].get("none", {}).get("eval_loss", []))
    for n, r in res["runs"].items():
        xs = range(1, len(r["train_loss"]) + 1)
        ema, smooth = None, []
        for v in r["train_loss"]:
            ema = v if ema is None else 0.8 * ema + 0.2 * v
            smooth.append(ema)
        axes[0].plot(xs, smooth, color=colours[n], label=label(n), lw=1.2)
        ex, ey = zip(*r["eval_loss"], strict=True)
        axes[1].plot(ex, ey, "o-", color=colours[n], ms=3, lw=1.2)
        rel = [(s, (v - base[s]) / base[s] * 100) for s, v in r["eval_loss"] if s in base]
        if rel:
            axes[2].plot(*zip(*rel, strict=True), "o-", color=colours[n], ms=3, lw=1.2)
    axes[0].set_title("train loss (EMA 0.8)")
    axes[1].set_title("held-out eval loss")
    axes[2].set_title("held-out eval loss vs no checkpointing (%)")
    axes[2].axhspan(-0.5, 0.5, color="0.9", zorder=0)
    axes[2].axhline(0, color="k", lw=0.8)
    for ax in axes:
        ax.set_xlabel("step")
    axes[0].set_ylabel("loss (nats/token)")
    axes[2].set_ylabel("% (grey band: +-0.5 %)")
    fig.legend(loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(
        f"{res['what']}: {res['steps']} steps x {res['batch_size']} x {res['seq_len']} tokens",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    return _save(fig, path)


def first_check_figure(out: Mapping[str, Any], path: Path) -> str:
    """The first GPU check in one figure: codec bandwidth against copy, step peaks against
    prediction and budget, tokens/s at the tight budget."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    sec = out.get("sections", {})
    _codec_panel(axes[0], sec.get("codecs", {}))
    _peak_panel(axes[1], sec.get("peaks", {}))
    _throughput_panel(axes[2], sec.get("throughput", {}))
    tests = sec.get("tests", {}).get("counts")
    fig.suptitle(f"first GPU check: {out.get('device')}; tests {tests}", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def _codec_panel(ax: Any, res: Mapping[str, Any]) -> None:
    rows = res.get("rows", [])
    colours = _pyplot().get_cmap("tab10").colors
    for i, name in enumerate(dict.fromkeys(r["codec"] for r in rows)):
        mine = [r for r in rows if r["codec"] == name]
        sizes, c = [r["size_mb"] for r in mine], colours[i % len(colours)]
        ax.plot(sizes, [r["encode_copy_ratio"] for r in mine], "o-", c=c, label=f"{name} encode")
        ax.plot(sizes, [r["decode_copy_ratio"] for r in mine], "x--", c=c, label=f"{name} decode")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("tensor size (MB)")
    ax.set_ylabel("GB/s / plain copy's")
    ax.set_title("codec bandwidth vs copy", fontsize=9)
    if rows:
        ax.legend(fontsize=6, ncol=2)


def _peak_panel(ax: Any, res: Mapping[str, Any]) -> None:
    rows = [r for r in res.get("budgets", []) if r.get("peak_nbytes") is not None]
    base = [(n, r) for n, r in res.get("baselines", {}).items() if r.get("peak_nbytes")]
    labels = [n for n, _ in base] + [f"adacc {r['fraction']:g}" for r in rows]
    entries = [r for _, r in base] + rows
    x = range(len(entries))
    for off, key, name in (
        (-0.27, "predicted_peak_nbytes", "predicted"),
        (0.0, "peak_nbytes", "allocated"),
        (0.27, "reserved_peak_nbytes", "reserved"),
    ):
        ax.bar([i + off for i in x], [(r.get(key) or 0) / MiB for r in entries], 0.27, label=name)
    for i, r in enumerate(entries):
        if r.get("budget_nbytes"):
            ax.hlines(r["budget_nbytes"] / MiB, i - 0.45, i + 0.45, colors="k", lw=1.5)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("step peak (MiB); black line: budget")
    ax.set_title(f"{res.get('model', '')} step peaks", fontsize=9)
    ax.legend(fontsize=7)


def _throughput_panel(ax: Any, res: Mapping[str, Any]) -> None:
    rows = {n: r for n, r in res.get("strategies", {}).items() if r.get("tokens_per_s")}
    names = list(rows)
    ax.bar(
        names,
        [rows[n]["tokens_per_s"] for n in names],
        color=["C0" if rows[n].get("fits") else "lightgrey" for n in names],
    )
    ax.set_ylabel("tokens / s (grey: over the budget)")
    budget = res.get("budget_nbytes", 0) / MiB
    ax.set_title(f"{res.get('model', '')} at {budget:.0f} MiB", fontsize=9)
    ax.tick_params(axis="x", labelsize=7)
