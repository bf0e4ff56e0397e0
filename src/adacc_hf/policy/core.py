"""`Policy`: the versioned, serialisable per-op artifact (schema + JSON + validation).

A policy holds, per block group, the ordered op list of one block (from a trace: key, layer type,
shape, dtype, bytes, aten op) and one or more *variants*: runs of consecutive blocks that share an
action table. A variant with ``checkpoint=False`` runs its blocks with no checkpoint machinery at
all (everything autograd saves is retained, zero overhead). Build one with the builders in
`adacc_hf.policy.builders` (over a trace), `adacc_hf.uniform_policy` & co. (over a model) or the
solver; apply it with `adacc_hf.apply_adacc`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..adapters import get_adapter, unwrap_model
from ..codecs import CodecError, get_codec
from ..errors import PolicyError
from ..schema import HEADS, POLICY_FORMAT, GroupPolicy
from .display import action_counts, table

if TYPE_CHECKING:
    from torch import nn

_KEYS = frozenset(
    {
        "adacc_hf_policy_format",
        "library_version",
        "model_type",
        "adapter",
        "adapter_version",
        "groups",
        "head",
        "metadata",
    }
)


#: Top-level fields of a policy file: (type, required, default when absent).
_FIELDS: dict[str, tuple[type | tuple[type, ...], bool, Any]] = {
    "model_type": (str, True, None),
    "adapter": (str, True, None),
    "groups": (dict, True, None),
    "adapter_version": (int, False, 1),
    "library_version": (str, False, "?"),
    "head": (str, False, "full"),
    "metadata": (dict, False, {}),
}


def _check_fields(obj: dict[str, Any]) -> None:
    """Presence and type of every top-level field (`_FIELDS`), before anything is built."""
    for name, (kind, required, _) in _FIELDS.items():
        if name not in obj:
            if required:
                raise PolicyError(f"corrupt adacc policy: the required field {name!r} is missing")
            continue
        value = obj[name]
        if isinstance(value, bool) or not isinstance(value, kind):
            raise PolicyError(
                f"corrupt adacc policy: field {name!r} must be a {kind.__name__}, got "
                f"{type(value).__name__} {value!r:.60}"
            )
    if obj.get("head", "full") not in HEADS:
        raise PolicyError(
            f"corrupt adacc policy: unknown head {obj['head']!r}: one of {list(HEADS)}"
        )


@dataclass
class Policy:
    """Per-op actions for every block of a model, plus where they came from (``metadata``).

    Made by the solver (`solve_policy`), the rule-based builders (`uniform_policy` & co.) or
    read from a file (``Policy.load(path)``; ``policy.save(path)`` writes one); applied with
    `apply_adacc`. ``policy.table()`` shows it op by op, ``policy.summary()`` counts actions.

    Attributes:
        model_type: the ``config.model_type`` it was made for.
        adapter: the adapter whose blocks it addresses.
        groups: per block group, one block's ops and the variants (runs of consecutive blocks
            sharing an action table) (`GroupPolicy`).
        metadata: where it came from: the source, the solver's prediction (``"predicted"``), the
            budget, ...
        adapter_version: that adapter's version.
        head: how the LM head and loss run (`HEADS`; ``"chunked"``: `runtime.head`).
        library_version: the adacc-hf version that made it.
        format_version: the policy's file format.
    """

    model_type: str
    adapter: str
    groups: dict[str, GroupPolicy]
    metadata: dict[str, Any] = field(default_factory=dict)
    adapter_version: int = 1
    head: str = "full"  # the LM head and loss: `HEADS` (``"chunked"``: `runtime.head`)
    library_version: str = __version__
    format_version: int = POLICY_FORMAT

    # ---------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        return {
            "adacc_hf_policy_format": self.format_version,
            "library_version": self.library_version,
            "model_type": self.model_type,
            "adapter": self.adapter,
            "adapter_version": self.adapter_version,
            "groups": {k: g.to_json() for k, g in sorted(self.groups.items())},
            "head": self.head,
            "metadata": self.metadata,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2)

    def save(self, path: str) -> None:
        """Write the policy as JSON (``adacc_policy.json``; `load` reads it back).

        Args:
            path: the file to write.
        """
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, obj: Any) -> Policy:
        if not isinstance(obj, dict):
            raise PolicyError("an adacc policy is a JSON object; this file holds something else")
        version = obj.get("adacc_hf_policy_format")
        if version is None:
            raise PolicyError("not an adacc-hf policy: the 'adacc_hf_policy_format' key is missing")
        if not isinstance(version, int) or version > POLICY_FORMAT:
            raise PolicyError(
                f"policy format {version!r} was written by a newer adacc-hf "
                f"({obj.get('library_version')}); this is {__version__} (format {POLICY_FORMAT}): "
                "upgrade adacc-hf, or re-create the policy"
            )
        unknown = sorted(set(obj) - _KEYS)
        if unknown:
            warnings.warn(f"ignoring unknown policy keys {unknown}", stacklevel=2)
        _check_fields(obj)
        try:
            groups = {str(k): GroupPolicy.from_json(g) for k, g in obj["groups"].items()}
            return cls(
                model_type=str(obj["model_type"]),
                adapter=str(obj["adapter"]),
                adapter_version=int(obj.get("adapter_version", 1)),
                library_version=str(obj.get("library_version", "?")),
                format_version=version,
                groups=groups,
                head=str(obj.get("head", "full")),
                metadata=dict(obj.get("metadata", {})),
            )
        except PolicyError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PolicyError(f"corrupt adacc policy: {type(e).__name__}: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> Policy:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise PolicyError(
                f"the policy is not valid JSON ({e}); re-create or re-save it"
            ) from None
        policy = cls.from_dict(obj)
        policy.check()
        return policy

    @classmethod
    def load(cls, path: str) -> Policy:
        """Read a policy `save` wrote (and check it).

        Args:
            path: the JSON file.

        Returns:
            The policy.

        Raises:
            PolicyError: the file cannot be read, is not a policy, is corrupt or was written by a
                newer adacc-hf.
        """
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise PolicyError(f"cannot read policy file {path!r}: {e}") from None
        try:
            return cls.from_json(text)
        except PolicyError as e:
            raise PolicyError(f"{path}: {e}") from None

    def __copy__(self) -> Policy:
        return Policy.from_dict(copy.deepcopy(self.to_dict()))

    def __deepcopy__(self, memo: dict) -> Policy:
        return self.__copy__()

    def fingerprint(self) -> str:
        """A short hash of the actions (not the metadata): equal on every rank running it."""
        body = {k: g.to_json() for k, g in sorted(self.groups.items())}
        parts = [self.model_type, body] + ([self.head] if self.head != "full" else [])
        text = json.dumps(parts, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------- validation
    def check(self) -> None:
        """Internal consistency: known codecs, actions only for known ops, non-cacheable ops
        (written in place after being read) recomputed."""
        if not self.groups:
            raise PolicyError("the policy has no block groups")
        if self.head not in HEADS:
            raise PolicyError(f"unknown head {self.head!r}: one of {list(HEADS)}")
        for name, g in self.groups.items():
            specs = {o.key: o for o in g.ops}
            if not g.variants or any(v.count < 0 for v in g.variants):
                raise PolicyError(f"group {name!r}: needs variants with non-negative counts")
            for v in g.variants:
                extra = sorted(set(v.actions) - set(specs))
                if extra:
                    raise PolicyError(
                        f"group {name!r}: actions for unknown ops {extra[:5]}; this policy is "
                        "corrupt or was edited by hand"
                    )
                for key, act in v.actions.items():
                    if act.kind != "recompute" and not specs[key].cacheable:
                        raise PolicyError(
                            f"group {name!r}: op {key} is mutated in place after it is read; it "
                            f"can only be recomputed, not {act}"
                        )
                    if act.codec is not None:
                        try:
                            get_codec(act.codec, **act.codec_kwargs)
                        except CodecError as e:
                            raise PolicyError(f"group {name!r}, op {key}: {e}") from None

    def repair(self) -> list[str]:
        """Recompute every statistic op kept beside a lossy input (`consistency`): returns the
        ``group/op`` names it changed (none for policies this library makes)."""
        from .consistency import repair_actions

        changed = []
        for name, g in self.groups.items():
            for v in g.variants:
                v.actions, bad = repair_actions(g.ops, v.actions, v.checkpoint)
                changed += [f"{name}/{key}" for key in bad]
        return sorted(set(changed))

    def validate(self, model: nn.Module) -> None:
        """Raise `PolicyError` if this policy was not made for `model`'s family and structure;
        repair (in place, with a warning) statistic ops kept beside a lossy input."""
        self.check()
        repaired = self.repair()
        if repaired:
            warnings.warn(
                f"this policy keeps {len(repaired)} fused-attention / norm op(s) exact beside a "
                f"lossy input ({', '.join(repaired[:6])}): their backward would mix statistics of "
                "exact inputs with altered ones (wrong gradients); they are recomputed instead",
                stacklevel=3,
            )
        adapter = get_adapter(model)
        base = unwrap_model(model)
        model_type = adapter.model_type(base)
        if model_type != self.model_type:
            raise PolicyError(
                f"this policy was made for a {self.model_type!r} model, not {model_type!r}: "
                "create a policy for this model (profile and solve, or adacc_hf.uniform_policy)"
            )
        groups = {g.name: len(g.modules) for g in adapter.block_groups(base)}
        mine = {k: g.num_blocks for k, g in self.groups.items()}
        if groups != mine:
            raise PolicyError(
                f"the policy's blocks {mine} do not match the model's {groups} (a different "
                "depth or architecture): create a policy for this model"
            )

    @property
    def offloads(self) -> bool:
        """Whether any block moves anything to host memory (`Variant.offloads`)."""
        return any(v.offloads for g in self.groups.values() for v in g.variants)

    # --------------------------------------------------------------------- display
    def table(self) -> str:
        """A human-readable per-op table (one per group and variant)."""
        return table(self)

    def summary(self) -> dict[str, dict[str, int]]:
        """Counts of each action per group (for logs and model cards)."""
        return action_counts(self)
