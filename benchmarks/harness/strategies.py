"""The registry of activation-memory strategies the benchmarks compare; every driver reads it.

Each `Strategy` names what a user would switch on, the label tables and plots show, its `kind`
(how it is prepared, installed and uninstalled: `benchmarks.harness.prepared`) and whether its
memory depends on the budget. `prepare` / `build` make them ready for one model, micro-batch and
budget; entering one installs it, leaving restores the model exactly::

    ready = build(["hf_full", "adacc"], model, batch, budget_nbytes=b, static_nbytes=s)
    with ready["adacc"] as s:
        train_step(model, batch, optimizer, s)      # benchmarks.harness.steps

`MAIN` is what users run today (no checkpointing, transformers' full checkpointing with and
without CPU offload or Liger's fused linear cross-entropy head (GPU), Megatron-style selective
recompute, naive INT4 on every saved activation)
and Adacc (static, with evolution, without outlier separation). The accuracy suite adds two fixed
policies that compress every saved activation, to show what the codecs themselves cost in loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from adacc_hf import Policy, attention_recompute_policy, uniform_policy
from adacc_hf.schema import CODEC_FOR_LAYER, LAYER_TYPES

from .adacc import NO_OUTLIER_CODEC, Profiles, profile_for
from .patching import liger_unavailable
from .prepared import (
    CompiledBudget,
    EvolvingPolicy,
    HFCheckpointing,
    NoCheckpointing,
    Prepared,
    RulePolicy,
    SolvedPolicy,
)

Batch = Mapping[str, Any]


@dataclass(frozen=True)
class Strategy:
    """One way to keep activations for backward."""

    name: str
    label: str
    kind: Callable[..., Prepared]  # `Prepared` subclass (options bound): install / uninstall
    budgeted: bool = False  # its policy is solved per budget
    accuracy_only: bool = False  # only the accuracy suite runs it
    # why it cannot run on a device ("": it can); None: it runs anywhere
    unavailable: Callable[[torch.device], str] | None = None


# fixed policies (rules over a traced model)
def naive_int4(model: nn.Module, batch: Batch) -> Policy:
    """The paper's "Quantization" baseline: every saved activation per-token INT4."""
    return uniform_policy(model, "compress", batch, codecs=dict.fromkeys(LAYER_TYPES, "int4_naive"))


def every_activation(model: nn.Module, batch: Batch) -> Policy:
    """Adacc's layer-specific codecs on every saved activation."""
    return uniform_policy(model, "compress", batch)


def every_activation_no_outlier(model: nn.Module, batch: Batch) -> Policy:
    """The same, with int4_naive (groups of 64) wherever int4_outlier would run."""
    codec, params = NO_OUTLIER_CODEC
    swap = {t: codec for t, c in CODEC_FOR_LAYER.items() if c == "int4_outlier"}
    return uniform_policy(model, "compress", batch, codecs=swap, codec_params={codec: params})


def _rule(rule: Callable[[nn.Module, Batch], Policy]) -> Callable[..., Prepared]:
    return partial(RulePolicy, rule=rule)


REGISTRY: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("none", "no checkpointing", NoCheckpointing),
        Strategy("hf_full", "HF full checkpointing", HFCheckpointing),
        Strategy(
            "hf_offload", "HF checkpointing + CPU offload", partial(HFCheckpointing, offload=True)
        ),
        Strategy(
            "hf_full_liger",
            "HF full checkpointing + Liger fused linear CE",
            partial(HFCheckpointing, liger=True),
            unavailable=liger_unavailable,
        ),
        Strategy(
            "megatron", "Megatron selective (attention core)", _rule(attention_recompute_policy)
        ),
        Strategy("naive_int4", "naive INT4 on all activations", _rule(naive_int4)),
        Strategy("adacc", "Adacc (static)", SolvedPolicy, budgeted=True),
        Strategy("adacc_adaptive", "Adacc + evolution", EvolvingPolicy, budgeted=True),
        Strategy(
            "adacc_no_outlier",
            "Adacc w/o outlier separation",
            partial(SolvedPolicy, no_outlier=True),
            budgeted=True,
        ),
        Strategy(
            "adacc_all",
            "Adacc codecs on every saved activation",
            _rule(every_activation),
            accuracy_only=True,
        ),
        Strategy(
            "adacc_all_no_outlier",
            "Adacc codecs on every saved activation, w/o outlier separation",
            _rule(every_activation_no_outlier),
            accuracy_only=True,
        ),
    )
}
#: What the throughput suites compare, in the order tables and plots show.
MAIN: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if not s.accuracy_only)


def unavailable(names: list[str], device: torch.device) -> dict[str, str]:
    """Of `names`, those that cannot run on `device`, with why (a run skips them, saying so)."""
    out = {}
    for n in names:
        why_not = REGISTRY[n].unavailable if n in REGISTRY else None
        if why_not is not None and (why := why_not(device)):
            out[n] = why
    return out


def label(name: str) -> str:
    try:
        return lookup(name).label
    except ValueError:
        return name


def check_names(names: list[str], known: Mapping[str, Any] | tuple[str, ...] = MAIN) -> None:
    """Exit with the known names when `names` holds another."""
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; known: {', '.join(known)}")


EVERY_N_PREFIX = "hf_every_"
OFFLOAD_EVERY_N_PREFIX = "hf_offload_every_"
#: transformers' ``every_n_layers`` with the largest ``k`` (fewest checkpointed layers, fastest)
#: whose measured step peak fits the budget, searched per budget and micro-batch
#: (`search.resolve_searched`): what a user tuning the one-line knob would pick. Without and
#: with ``offload=True``. Each resolves to ``hf_every_<k>`` / ``hf_offload_every_<k>``, or to
#: ``hf_full`` / ``hf_offload`` when no ``k >= 2`` fits.
SEARCHED: dict[str, tuple[str, str]] = {
    "hf_every_n": (EVERY_N_PREFIX, "hf_full"),
    "hf_offload_every_n": (OFFLOAD_EVERY_N_PREFIX, "hf_offload"),
    "compile_budget": ("compile_budget_", "compile_budget_0"),  # `COMPILE_FRACTIONS` scanned
}


def every_n(k: int, offload: bool = False) -> Strategy:
    """transformers' ``every_n_layers=k``: checkpoint every k-th layer, keep the others whole
    (named ``hf_every_<k>``; ``offload``: the checkpointed layers' inputs on the CPU,
    ``hf_offload_every_<k>``)."""
    if k < 2:
        raise ValueError(f"every_n_layers needs k >= 2 (k = 1 is hf_full), got {k}")
    prefix = OFFLOAD_EVERY_N_PREFIX if offload else EVERY_N_PREFIX
    label = f"HF checkpointing{' + CPU offload' if offload else ''} every {k} layers"
    return Strategy(f"{prefix}{k}", label, partial(HFCheckpointing, every_n=k, offload=offload))


COMPILE_PREFIX = "compile_budget_"
#: ``torch.compile``'s ``activation_memory_budget`` a user would try, in order (keep the most
#: first); `search.resolve_searched` picks the first whose measured step peak fits. The
#: partitioner's peak is not monotone in the knob (pytorch#197838), hence a scan, not a bisection.
COMPILE_FRACTIONS = (1.0, 0.5, 0.25, 0.0)


def compile_budget(fraction: float) -> Strategy:
    """``torch.compile`` with ``activation_memory_budget = fraction`` (``compile_budget_<f>``)."""
    label = f"torch.compile, activation_memory_budget {fraction:g}"
    return Strategy(
        f"{COMPILE_PREFIX}{fraction:g}", label, partial(CompiledBudget, fraction=fraction)
    )


def lookup(name: str) -> Strategy:
    """The registry's strategy `name`, ``hf_every_<k>``, ``hf_offload_every_<k>`` or
    ``compile_budget_<fraction>``."""
    if name in REGISTRY:
        return REGISTRY[name]
    if name.startswith(COMPILE_PREFIX):
        try:
            return compile_budget(float(name[len(COMPILE_PREFIX) :]))
        except ValueError:
            pass
    for prefix, offload in ((EVERY_N_PREFIX, False), (OFFLOAD_EVERY_N_PREFIX, True)):
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            return every_n(int(name[len(prefix) :]), offload)
    known = ", ".join(
        [*REGISTRY, f"{EVERY_N_PREFIX}<k>", f"{OFFLOAD_EVERY_N_PREFIX}<k>", f"{COMPILE_PREFIX}<f>"]
    )
    raise ValueError(f"unknown strategy {name!r}; known: {known}")


def prepare(name: str, model: nn.Module, batch: Batch, **kwargs: Any) -> Prepared:
    """Strategy `name` for `model` and `batch` (not prepared yet: `.prepare()` or enter it).
    kwargs: ``budget_nbytes``, ``static_nbytes``, ``profiles``, ``profile_repeats``."""
    s = lookup(name)
    return s.kind(s, model, batch, **kwargs)


def build(
    names: list[str],
    model: nn.Module,
    batch: Batch,
    *,
    budget_nbytes: int | None,
    static_nbytes: int,
    profiles: Profiles | None = None,
    profile_repeats: int = 3,
) -> dict[str, Prepared]:
    """Prepare `names` for one model, batch and budget, profiling once for all Adacc strategies."""
    budgeted = [n for n in names if lookup(n).budgeted]
    if budgeted and profiles is None:
        no_outlier = "adacc_no_outlier" in budgeted
        profiles = profile_for(model, batch, profile_repeats, no_outlier=no_outlier)
    kw = dict(budget_nbytes=budget_nbytes, static_nbytes=static_nbytes, profiles=profiles)
    return {
        n: prepare(n, model, batch, profile_repeats=profile_repeats, **kw).prepare() for n in names
    }
