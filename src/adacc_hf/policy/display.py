"""Ways to show a policy: the per-op table, action counts, a one-line description, log metrics,
and the short summaries that go into model cards and ``config.json``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, Protocol

from .._version import __version__
from ..schema import GroupPolicy
from ..units import fmt_bytes


class Policy(Protocol):
    """What display reads of a `Policy` (kept structural: `core` builds on this module)."""

    groups: Mapping[str, GroupPolicy]
    metadata: dict[str, Any]

    def fingerprint(self) -> str: ...


_MiB = 2**20


def table(policy: Policy) -> str:
    """A human-readable per-op table (one per group and variant)."""
    lines = []
    for name, g in sorted(policy.groups.items()):
        for vi, v in enumerate(g.variants):
            if v.count == 0:
                continue
            head = f"[{name}] {v.count} block(s)"
            if len(g.variants) > 1:
                head += f", variant {vi}"
            if not v.checkpoint:
                lines.append(head + ": no checkpointing (every activation retained)")
                continue
            lines.append(head + f": block input {g.input_nbytes / _MiB:.2f} MiB retained")
            lines.append(f"  {'op':44s} {'layer type':13s} {'shape':22s} {'MiB':>8s}  action")
            for op in g.ops:
                shape = "x".join(str(s) for s in op.shape)
                lines.append(
                    f"  {op.key:44s} {op.layer_type:13s} {shape:22s} "
                    f"{op.nbytes / _MiB:8.3f}  {v.action(op.key)}"
                )
    return "\n".join(lines)


def action_counts(policy: Policy) -> dict[str, dict[str, int]]:
    """Per group: how many (block, op) pairs get each action (``compress:<codec>`` by codec),
    ``no_checkpoint_blocks`` and ``offloaded_inputs`` (checkpointed blocks whose input is held in
    host memory)."""
    out: dict[str, dict[str, int]] = {}
    for name, g in sorted(policy.groups.items()):
        counts: Counter[str] = Counter()
        for v in g.variants:
            if not v.checkpoint:
                counts["no_checkpoint_blocks"] += v.count
                continue
            if v.offload_input:
                counts["offloaded_inputs"] += v.count
            for op in g.ops:
                counts[str(v.action(op.key)).split("(")[0]] += v.count
        out[name] = dict(counts)
    return out


def totals(policy: Policy) -> dict[str, int]:
    """Action kinds over the whole model (codecs folded into ``compress``)."""
    counts: Counter[str] = Counter()
    for g in action_counts(policy).values():
        for k, v in g.items():
            counts[k.split(":")[0]] += v
    return dict(sorted(counts.items()))


def by_layer_type(policy: Policy) -> dict[str, dict[str, int]]:
    """Per layer type: how many (block, op) pairs retain, compress or recompute (checkpointed
    blocks only)."""
    out: dict[str, Counter[str]] = {}
    for g in policy.groups.values():
        for v in g.variants:
            if not v.checkpoint:
                continue
            for op in g.ops:
                out.setdefault(op.layer_type, Counter())[v.action(op.key).kind] += v.count
    return {k: dict(sorted(c.items())) for k, c in sorted(out.items())}


def describe(policy: Policy) -> str:
    """One line: source, predicted peak and added time, action totals."""
    pred = policy.metadata.get("predicted", {})
    parts = [str(policy.metadata.get("source", "?"))]
    if "peak_nbytes" in pred:
        budget = policy.metadata.get("budget_nbytes")
        of = f" of the {fmt_bytes(budget)} budget" if isinstance(budget, int) else ""
        parts.append(f"predicted step peak {fmt_bytes(pred['peak_nbytes'])}{of}")
    if "added_ms" in pred:
        parts.append(f"{pred['added_ms']:+.1f} ms/step")
    parts.append(", ".join(f"{k} {v}" for k, v in totals(policy).items()))
    return "; ".join(parts)


def metrics(policy: Policy) -> dict[str, float]:
    """Numbers for the Trainer log: predicted memory (MiB), added time, action totals."""
    pred = policy.metadata.get("predicted", {})
    out: dict[str, float] = {}
    for k in ("peak", "held", "transient"):
        if isinstance(pred.get(f"{k}_nbytes"), (int, float)):
            out[f"adacc/predicted_{k}_mib"] = pred[f"{k}_nbytes"] / _MiB
    if isinstance(pred.get("added_ms"), (int, float)):
        out["adacc/predicted_added_ms"] = float(pred["added_ms"])
    for k, v in totals(policy).items():
        out[f"adacc/{k}_ops"] = float(v)
    return out


def config_summary(policy: Policy) -> dict[str, Any]:
    """The small ``adacc`` entry for ``config.json`` (the full policy is ``adacc_policy.json``)."""
    meta = policy.metadata
    return {
        "library_version": __version__,
        "policy_file": "adacc_policy.json",
        "policy_fingerprint": policy.fingerprint(),
        "budget": meta.get("budget_spec"),
    }


def card_section(policy: Policy, measured_peak_nbytes: int | None = None) -> str:
    """A short Markdown section for the model card: budget, memory, actions per layer type."""
    meta = policy.metadata
    pred = meta.get("predicted", {})

    def mib(n: Any) -> str:
        return f"{n / _MiB:,.1f} MiB" if isinstance(n, (int, float)) else "n/a"

    lines = [
        "## Activation memory (adacc-hf)",
        "",
        f"Trained with adacc-hf {__version__}: per op of "
        "each transformer block, activations were retained, compressed or recomputed to fit a "
        "memory budget. The policy is saved beside the weights as `adacc_policy.json` "
        f"(fingerprint `{policy.fingerprint()}`).",
        "",
        f"- budget: {meta.get('budget_spec', 'n/a')} ({mib(meta.get('budget_nbytes'))} per device)",
        f"- predicted step peak: {mib(pred.get('peak_nbytes'))}",
    ]
    if measured_peak_nbytes is not None:
        lines.append(
            f"- measured peak allocated (the whole run, profiling included): "
            f"{mib(measured_peak_nbytes)}"
        )
    if "added_ms" in pred:
        lines.append(f"- predicted added time: {pred['added_ms']:.1f} ms per step")
    rows = by_layer_type(policy)
    if rows:
        lines += ["", "| layer type | retain | compress | recompute |", "|---|---|---|---|"]
        for lt, c in rows.items():
            lines.append(
                f"| {lt} | {c.get('retain', 0)} | {c.get('compress', 0)} | {c.get('recompute', 0)} |"
            )
    plain = sum(c.get("no_checkpoint_blocks", 0) for c in action_counts(policy).values())
    if plain:
        lines += ["", f"{plain} block(s) ran without checkpointing (everything retained)."]
    return "\n".join(lines) + "\n"
