"""`AdaccConfig`: what a session does (the budget and the option groups of `options`) and the
facts of the run it plans for (`facts.RunFacts`)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import Unpack

from ..errors import AdaccError
from .facts import FACTS, RunFacts, detect_autocast, warn_facts, warn_future
from .options import (
    GROUPS,
    OPTION_GROUP,
    CodecOptions,
    CompileOptions,
    FlatOptions,
    MemoryOptions,
    OffloadOptions,
    SolverOptions,
    TrackingOptions,
)

__all__ = ["AdaccConfig", "detect_autocast"]

#: What the flat names of the old layout read now: each option's group, each fact's ``run``, and
#: the groups' methods (`AdaccConfig.__getattr__`, one release).
_MOVED = {
    **OPTION_GROUP,
    **dict.fromkeys(FACTS, "run"),
    "codec_params": "compression",
    "offloads_on": "offloading",
    "host_cap_nbytes": "offloading",
    "static_options": "run",
    "autocast": "run",
}
_PARTS = (*GROUPS, "run")


@dataclass(init=False)
class AdaccConfig:
    """The options of an `AdaccSession`: the budget, the option groups and the facts of the run.

    Every option has one name: its group's field, the keyword by which `AdaccConfig`, `prepare`
    and `AdaccCallback` take it and ``--adacc_<name>`` of `AdaccTrainingArguments`. Give options
    by name (``AdaccConfig(budget="20GiB", codecs=["int4_outlier"], adaptive=False)``) or as
    groups (``AdaccConfig(solving=SolverOptions(head="auto"))``), not both for one option. Each
    group checks its options when it is made. The facts of the run are read off it by the entry
    points (`facts`); ``run=`` states them. ``config.with_run(...)`` and ``config.replace(...)``
    return changed copies; `to_dict` / `from_dict` (or ``AdaccConfig(**config.to_dict())``)
    round trip.

    Attributes:
        budget (int | str, default ``"auto"``): the step's device memory budget per device:
            bytes, ``"20GiB"`` (powers of 2), ``"20GB"`` (powers of 10), ``"80%"`` of device
            memory or ``"auto"`` (what is free plus what the model already holds, minus max(1
            GiB, 5 %)); see `parse_budget`.
        memory (MemoryOptions): ``headroom``, ``allocator``, ``expandable_segments``,
            ``max_seq_len``, ``auto_batch_size``.
        compression (CodecOptions): ``codecs``, ``codec_backends``, ``zscore_threshold``,
            ``max_codec_error``, ``max_grad_error``.
        offloading (OffloadOptions): ``offload``, ``offload_host_cap``.
        compilation (CompileOptions): ``compile``.
        solving (SolverOptions): ``solver``, ``solver_time_limit``, ``split_blocks``, ``head``,
            ``profile_repeats``.
        tracking (TrackingOptions): ``adaptive``, ``max_tracking_interval``, ``profile_from``.
        run (RunFacts): the optimizer, mixed precision, accumulation and sharding of the run.

    Args:
        budget: see Attributes.
        memory: the group (or a mapping of its fields); None: from the options given by name.
        compression: as `memory`.
        offloading: as `memory`.
        compilation: as `memory`.
        solving: as `memory`.
        tracking: as `memory`.
        run: the facts of the run (or a mapping of them); None: `RunFacts`'s defaults.
        **options: any option of a group by its name (`options.FlatOptions`). A fact of the
            run by its name still works for one release, with an `AdaccFutureWarning`.

    Raises:
        AdaccError: an option a group refuses (see each group), an option given both by name
            and in its group, or ``compile`` with ``offload=True``.
        TypeError: a keyword that is no option.

    Example:
        >>> cfg = AdaccConfig(budget="20GiB", codecs=["int4_outlier"], max_seq_len=4096)
        >>> cfg.memory.max_seq_len, cfg.compression.codecs
        (4096, ['int4_outlier'])
        >>> cfg.replace(head="auto").solving.head
        'auto'
    """

    budget: int | str = "auto"
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    compression: CodecOptions = field(default_factory=CodecOptions)
    offloading: OffloadOptions = field(default_factory=OffloadOptions)
    compilation: CompileOptions = field(default_factory=CompileOptions)
    solving: SolverOptions = field(default_factory=SolverOptions)
    tracking: TrackingOptions = field(default_factory=TrackingOptions)
    run: RunFacts = field(default_factory=RunFacts)

    def __init__(
        self,
        budget: int | str = "auto",
        *,
        memory: MemoryOptions | Mapping[str, Any] | None = None,
        compression: CodecOptions | Mapping[str, Any] | None = None,
        offloading: OffloadOptions | Mapping[str, Any] | None = None,
        compilation: CompileOptions | Mapping[str, Any] | None = None,
        solving: SolverOptions | Mapping[str, Any] | None = None,
        tracking: TrackingOptions | Mapping[str, Any] | None = None,
        run: RunFacts | Mapping[str, Any] | None = None,
        **options: Unpack[FlatOptions],
    ) -> None:
        given = dict(
            memory=memory,
            compression=compression,
            offloading=offloading,
            compilation=compilation,
            solving=solving,
            tracking=tracking,
            run=run,
        )
        named: dict[str, dict[str, Any]] = {part: {} for part in _PARTS}
        for name, value in options.items():
            named[_part_of(name)][name] = value
        warn_facts(named["run"])
        object.__setattr__(self, "budget", budget)
        for part, cls in {**GROUPS, "run": RunFacts}.items():
            object.__setattr__(self, part, _group(part, cls, given[part], named[part]))
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.compilation.compile is None:
            return
        if self.offloading.offload:
            raise AdaccError(
                f"compile={self.compilation.compile!r} with offload=True: offload has no compiled "
                "form yet; leave offload out (or False) or leave compile off"
            )
        if self.offloading.offload is None:
            object.__setattr__(
                self, "offloading", dataclasses.replace(self.offloading, offload=False)
            )

    def replace(self, **changes: Any) -> AdaccConfig:
        """A copy with `changes`: options by name (``cfg.replace(budget=..., head="auto")``) or
        whole groups (``memory=MemoryOptions(...)``, ``run=...``).

        Args:
            **changes: ``budget``, options by name, or groups by their attribute.

        Returns:
            The new config (checked as any).

        Raises:
            AdaccError: a fact of the run by name (use `with_run`), or an option given both by
                name and in its group.
            TypeError: a keyword that is no option.
        """
        parts: dict[str, Any] = {"budget": self.budget}
        parts.update({part: getattr(self, part) for part in _PARTS})
        named: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            if name in parts:
                parts[name] = value
            elif name in FACTS:
                raise AdaccError(f"{name} is a fact of the run: config.with_run({name}=...)")
            else:
                named.setdefault(_part_of(name), {})[name] = value
        for part, values in named.items():
            if part in changes:
                raise AdaccError(_both(values, part))
            parts[part] = dataclasses.replace(parts[part], **values)
        return AdaccConfig(**parts)

    def with_run(self, run: RunFacts | None = None, **facts: Any) -> AdaccConfig:
        """A copy with other facts of the run: `run` (default: this config's) with `facts`.

        Args:
            run: the facts to plan for instead.
            **facts: facts by name (`RunFacts` fields), over `run`'s.

        Returns:
            The new config.
        """
        run = dataclasses.replace(run or self.run, **facts)
        return AdaccConfig(self.budget, **{part: getattr(self, part) for part in GROUPS}, run=run)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (JSON-serialisable where the budget is).

        Returns:
            ``budget`` and each group as a dict of its fields.
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdaccConfig:
        """The config `to_dict` wrote (options by name, the old flat layout, also work).

        Args:
            data: what `to_dict` returned, or ``AdaccConfig``'s keywords.

        Returns:
            The config.
        """
        return cls(**data)

    def __getattr__(self, name: str) -> Any:
        part = _MOVED.get(name)
        if part is None or part not in self.__dict__:
            raise AttributeError(f"'AdaccConfig' object has no attribute {name!r}")
        warn_future(
            f"AdaccConfig.{name} is AdaccConfig.{part}.{name} now (options are grouped); the "
            "flat name goes in the next release"
        )
        return getattr(self.__dict__[part], name)

    def __setattr__(self, name: str, value: Any) -> None:
        part = _MOVED.get(name)
        if part is None or name not in (OPTION_GROUP.keys() | set(FACTS)):
            object.__setattr__(self, name, value)
            return
        warn_future(
            f"AdaccConfig.{name} is AdaccConfig.{part}.{name} now (options are grouped): "
            f"config.replace({name}=...) or config.with_run(...); the flat name goes in the next "
            "release"
        )
        object.__setattr__(self, part, dataclasses.replace(getattr(self, part), **{name: value}))


def _part_of(name: str) -> str:
    """The attribute of `AdaccConfig` holding the option or fact `name`."""
    if name in OPTION_GROUP:
        return OPTION_GROUP[name]
    if name in FACTS:
        return "run"
    near = difflib.get_close_matches(name, [*OPTION_GROUP, *FACTS], n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise TypeError(f"AdaccConfig has no option {name!r}{hint}")


def _group(part: str, cls: type, given: Any, named: dict[str, Any]) -> Any:
    """The group `part`: `given` (an instance or a mapping of its fields), else made of the
    options `named`."""
    if given is None:
        return cls(**named)
    if named:
        raise AdaccError(_both(named, part))
    if isinstance(given, Mapping):
        return cls(**given)
    if not isinstance(given, cls):
        raise AdaccError(
            f"{part} must be a {cls.__name__} (or a dict of its fields), not {given!r}"
        )
    return given


def _both(named: Mapping[str, Any], part: str) -> str:
    names = ", ".join(sorted(named))
    return (
        f"{names} given both by name and in {part}=: give each option once (to change options of "
        f"a config: config.replace({names.split(', ')[0]}=...))"
    )
