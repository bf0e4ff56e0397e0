"""A block's retain / recompute decisions under ``torch.compile``: selective-checkpoint tags.

The eager runtime keeps op outputs with Python dispatch modes, which dynamo cannot trace. Under
compile the same decisions go to torch's selective activation checkpointing: the block runs
``checkpoint(fn, context_fn=...)`` with `create_selective_checkpoint_contexts`, whose policy
function is called for every op while the graph is traced (not at step time) and tags it
``MUST_SAVE`` (the policy retains it) or ``MUST_RECOMPUTE``; the partitioner honours the tags
when it splits forward from backward.

The compiled trace is not the eager one op for op: the causal mask is built by other ops, CPU
dropout becomes ``native_dropout``, and the trace may run twice (torch calls the context function
once per pass, so each pass starts a fresh `Aligner`). The aligner walks the policy's keyed ops
in order and matches each traced keyed op to the next op of the same overload within a short
window; an op it cannot match is recomputed (the safe side for the budget). Random ops are left to
the partitioner (``PREFER_RECOMPUTE``: compile replays their RNG itself); attention called with
``dropout_p=0`` is tagged random but draws nothing (`ops.draws_random`), and is tagged as planned.

A compressed op is tagged ``MUST_SAVE`` and its node marked with its codec: `saved_codecs`
encodes it in the compiled forward and decodes it in the compiled backward. Offload has no
compiled form: a variant that offloads anything is refused when the block is traced, naming the
op (see docs/compile.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..errors import AdaccError
from ..schema import Action, OpSpec
from . import saved_codecs
from .ops import draws_random, is_keyed

logger = logging.getLogger("adacc_hf")
_RECOMPUTE = Action.recompute()
_WARNED: list[bool] = []  # once per process
#: How far ahead of its position the aligner looks for a traced op's match in the policy.
WINDOW = 8


class Aligner:
    """One traced pass of a block: each keyed op's tag by its match in the policy."""

    def __init__(self, wanted: Sequence[tuple[str, str | None]]) -> None:
        # (op overload, what to do) per keyed op of the policy, in order: "retain", a codec spec
        # (`saved_codecs.spec`) or None (recompute)
        self.wanted = wanted
        self.lossy = any(todo not in (None, "retain") for _, todo in wanted)
        self.pos = 0
        self.saved: list[str] = []  # overloads tagged MUST_SAVE, in order (for tests and logs)
        self.unmatched: list[str] = []

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if ctx.is_recompute or not is_keyed(op):
            return CheckpointPolicy.PREFER_RECOMPUTE
        if draws_random(op, args, kwargs):
            self._match(str(op))
            return CheckpointPolicy.PREFER_RECOMPUTE
        keep = self._match(str(op))
        if keep is None:
            if self.lossy and self.pos == len(self.wanted):
                # the block's output (its last op): recomputed, it would be rebuilt from decoded
                # values and feed the next block; eager's next checkpoint saves it exact
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.MUST_RECOMPUTE
        if keep != "retain" and self.pos == len(self.wanted):
            # the block's output compressed: saved whole instead (eager's next checkpoint saves
            # it exact; decoded, it would feed the next block's recompute)
            keep = "retain"
        if keep != "retain":
            if not saved_codecs.installed():
                raise AdaccError(
                    f"op {op} is planned as compressed, but adacc's compiled-codec hooks are not "
                    "installed in this thread (it would be saved whole, over the plan): apply a "
                    "policy planned with prepare(..., compile=<backend>) or the Trainer's "
                    "torch_compile=True, in the thread that trains"
                )
            saved_codecs.mark(op, keep)
        self.saved.append(str(op))
        return CheckpointPolicy.MUST_SAVE

    def _match(self, name: str) -> str | None:
        for i in range(self.pos, min(self.pos + WINDOW, len(self.wanted))):
            if self.wanted[i][0] == name:
                self.pos = i + 1
                return self.wanted[i][1]
        self.unmatched.append(name)
        return None


def compile_refusal(
    path: str, actions: dict[str, Action], offload_input: bool, planned_for_compile: bool
) -> str | None:
    """Why block `path`'s variant cannot run under compile (None: it can). Compression runs only
    for a policy planned with ``compile=`` (its codec hooks are installed with it)."""
    if offload_input:
        return f"block {path} offloads its input"
    for key, a in actions.items():
        if a.kind == "offload" or (a.kind == "compress" and not planned_for_compile):
            return f"block {path}: op {key} is planned as {a.kind}" + (
                f":{a.codec}" if a.codec else ""
            )
    return None


#: Tests and diagnostics: when a list, every traced pass's `Aligner` is appended to it.
RECORD: list[Aligner] | None = None


def _todo(a: Action) -> str | None:
    if a.kind == "retain":
        return "retain"
    return saved_codecs.spec(a) if a.kind == "compress" else None


def wanted(
    specs: Sequence[OpSpec], actions: dict[str, Action]
) -> tuple[tuple[str, str | None], ...]:
    """(op overload, "retain" / codec spec / None for recompute) per keyed op of a block's
    policy, in order."""
    return tuple((s.aten, _todo(actions.get(s.key, _RECOMPUTE))) for s in specs)


def contexts(
    wanted: tuple[tuple[str, str | None], ...], eager_plan: bool = True
) -> tuple[Any, Any]:
    """The checkpoint's ``context_fn`` under compile, as ``functools.partial(contexts, wanted,
    eager_plan)`` (dynamo takes a partial of a module function, made before tracing): a fresh
    `Aligner` for each traced pass. `eager_plan`: the policy was planned from an eager profile
    (not ``compile=``): warned once."""
    if eager_plan and not _WARNED:
        _WARNED.append(True)
        logger.warning(
            "adacc: a block runs under torch.compile, but its policy was planned from an eager "
            "profile and compiled graphs hold other bytes (tiny llama: +20 % under full "
            "recomputation): plan with prepare(..., compile=<backend>) or the Trainer's "
            "torch_compile=True (docs/compile.md)"
        )
    aligner = Aligner(wanted)
    if RECORD is not None:
        RECORD.append(aligner)
    return create_selective_checkpoint_contexts(aligner.policy)


def refuse(reason: str) -> AdaccError:
    return AdaccError(
        f"{reason}, which torch.compile cannot run here: offload has no compiled form, and "
        "compression runs compiled only for a policy planned with prepare(..., compile=<backend>) "
        "(or the Trainer's torch_compile=True). Plan with compile and offload=False, or leave "
        "torch.compile off; see docs/compile.md"
    )
