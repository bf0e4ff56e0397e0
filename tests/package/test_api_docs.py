"""The public API documents itself (issue 53): every function and class in ``adacc_hf.__all__``
(lazy names included) and every public method of `AdaccSession` has a Google-style docstring with
a one-line summary and each of its parameters in ``Args:`` (a class's constructor parameters or
dataclass fields: ``Args:`` or ``Attributes:``), and ``Returns:`` where it returns something.
``help(adacc_hf.prepare)`` then reads as a reference."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

import pytest

import adacc_hf
from adacc_hf.engine.options import GROUPS, OPTION_GROUP

HEADER = re.compile(r"^(\w[\w ]*):\s*$")
#: An entry of a section: ``name: text``, ``name (type): text`` or ``*args, **kwargs: text``.
ENTRY = re.compile(r"^(\*{0,2}\w+(?:, \*{0,2}\w+)*)(?: \([^)]*\))?:(?:\s|$)")


def sections(doc: str) -> dict[str, str]:
    """The Google-style sections of a cleaned docstring (`inspect.cleandoc`): header -> body."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in doc.splitlines():
        m = HEADER.match(line)
        if m:
            current = found.setdefault(m.group(1), [])
        elif current is not None and line.strip() and not line.startswith(" "):
            current = None  # prose after a section
        elif current is not None:
            current.append(line)
    return {name: inspect.cleandoc("\n".join(lines)) for name, lines in found.items()}


def documented(body: str) -> set[str]:
    """The names a section's entries document (its unindented lines after `inspect.cleandoc`)."""
    names: set[str] = set()
    for line in body.splitlines():
        m = ENTRY.match(line)
        if m:
            names.update(m.group(1).split(", "))
    return names


def parameters(obj: Any) -> tuple[list[str], bool]:
    """What `obj`'s docstring must document: its parameters (``*args`` / ``**kwargs`` with their
    stars; a class: its constructor's, of a dataclass the fields it declares itself, not a base's
    such as `TrainingArguments`'), and whether it returns something."""
    if inspect.isclass(obj):
        if dataclasses.is_dataclass(obj):
            own = inspect.get_annotations(obj)
            return [f.name for f in dataclasses.fields(obj) if f.init and f.name in own], False
        if "__init__" not in vars(obj):
            return [], False  # an error class: BaseException's constructor
        obj = obj.__init__
    sig = inspect.signature(obj)
    names = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls"):
            continue
        stars = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        names.append(stars + p.name)
    returns = sig.return_annotation not in (inspect.Signature.empty, None, "None")
    return names, returns


def problems(obj: Any) -> list[str]:
    """What `obj`'s docstring lacks (empty: a complete reference entry)."""
    doc = inspect.getdoc(obj) if obj.__doc__ else None
    if not doc:
        return ["no docstring"]
    lines = doc.splitlines()
    out = []
    if len(lines) > 1 and lines[1].strip():
        out.append("the summary is not one line followed by a blank line")
    names, returns = parameters(obj)
    found = sections(doc)
    kinds = ("Args", "Attributes") if inspect.isclass(obj) else ("Args",)
    listed = set().union(*(documented(found.get(k, "")) for k in kinds))
    missing = [n for n in names if n not in listed]
    if missing:
        out.append(f"not in {' / '.join(k + ':' for k in kinds)} {missing}")
    if returns and "Returns" not in found:
        out.append("no Returns: section")
    return out


def public_api() -> dict[str, Any]:
    """Every callable of ``adacc_hf.__all__`` (lazy ones resolved) and `AdaccSession`'s public
    methods, by name."""
    api = {n: getattr(adacc_hf, n) for n in adacc_hf.__all__}
    api = {n: o for n, o in api.items() if callable(o)}
    session = adacc_hf.AdaccSession
    for name, member in vars(session).items():
        if not name.startswith("_") and inspect.isfunction(member):
            api[f"AdaccSession.{name}"] = member
    return api


API = public_api()


def test_every_lazy_name_resolves():
    for name in adacc_hf.__all__:
        assert getattr(adacc_hf, name) is not None, name
    assert "prepare" in API and "AdaccConfig" in API and "AdaccSession.step_done" in API


@pytest.mark.parametrize("name", sorted(API))
def test_documents_every_argument(name):
    assert problems(API[name]) == [], name


def _attributes(cls: type) -> set[str]:
    return documented(sections(inspect.getdoc(cls)).get("Attributes", ""))


@pytest.mark.parametrize(
    "cls", [*GROUPS.values(), adacc_hf.RunFacts, adacc_hf.AdaccConfig], ids=lambda c: c.__name__
)
def test_every_option_and_fact_is_documented_in_its_group(cls):
    """Each group's ``Attributes:`` documents every field it has and no other, with its type and
    default (``name (type, default X): ...``), and the group has an ``Example:``."""
    fields = [f.name for f in dataclasses.fields(cls)]
    listed = _attributes(cls)
    assert [f for f in fields if f not in listed] == []
    assert listed <= set(fields), "documented fields that do not exist"
    doc = inspect.getdoc(cls)
    assert "Example" in sections(doc), cls.__name__
    if cls is not adacc_hf.AdaccConfig:
        for name in fields:
            assert re.search(rf"^    {name} \([^)]*default [^)]*\): ", doc, re.M), name


def entries(body: str) -> dict[str, str]:
    """A section's entries: name -> its text (continuation lines included)."""
    out: dict[str, str] = {}
    for line in body.splitlines():
        m = ENTRY.match(line)
        if m:
            name = m.group(1)
            out[name] = line[m.end() :]
        elif out:
            out[name] += " " + line.strip()
    return out


def test_the_config_groups_are_its_attributes_and_name_their_options():
    """`AdaccConfig`'s entry for each group lists the options the group holds."""
    found = entries(sections(inspect.getdoc(adacc_hf.AdaccConfig))["Attributes"])
    for attr, cls in GROUPS.items():
        for f in dataclasses.fields(cls):
            assert f"``{f.name}``" in found[attr], (attr, f.name)


def test_training_arguments_fields_match_their_help():
    """Each ``adacc_*`` option: in the class docstring and with a ``help`` (for ``--help``)."""
    cls = adacc_hf.AdaccTrainingArguments
    listed = documented(sections(inspect.getdoc(cls)).get("Attributes", ""))
    for f in dataclasses.fields(cls):
        if f.name == "adacc" or f.name.startswith("adacc_"):
            assert f.name in listed, f.name
            assert f.metadata.get("help"), f.name


def test_the_check_fails_on_an_undocumented_argument():
    def documented_fn(a: int, *rest: int, b: str = "", **options: Any) -> int:
        """Add.

        Args:
            a: one.
            *rest: more.
            b: a name.
            **options: anything.

        Returns:
            The sum.
        """
        return a

    def undocumented_fn(a: int, b: str = "", **options: Any) -> int:
        """Add.

        Args:
            a: one.

        Note:
            b: not an argument here.
        """
        return a

    assert problems(documented_fn) == []
    assert problems(undocumented_fn) == [
        "not in Args: ['b', '**options']",
        "no Returns: section",
    ]
    undocumented_fn.__doc__ = None
    assert problems(undocumented_fn) == ["no docstring"]


def test_help_reads_as_a_reference():
    text = inspect.getdoc(adacc_hf.prepare)
    assert text.splitlines()[0].startswith("Adacc for custom loops")
    for section in ("Args:", "Returns:", "Raises:"):
        assert f"\n{section}\n" in text


def test_the_typed_keywords_are_the_group_fields():
    """`prepare(**options)`, `AdaccCallback(**options)` and `AdaccConfig(**options)` are typed by
    `engine.options`: its keys are the groups' fields, one name each, of the same type (prepare
    names four options itself, and the facts it reads off the run are no keys)."""
    from adacc_hf import prepare
    from adacc_hf.engine.options import AdaccOptions, FlatOptions, SessionOptions

    types = {f.name: f.type for cls in GROUPS.values() for f in dataclasses.fields(cls)}
    assert set(FlatOptions.__optional_keys__) == set(types) == set(OPTION_GROUP)
    assert set(AdaccOptions.__optional_keys__) == set(types) | {"budget"}
    own = set(inspect.signature(prepare).parameters) & set(AdaccOptions.__optional_keys__)
    assert own == {"budget", "codecs", "adaptive", "auto_batch_size"}
    assert set(SessionOptions.__optional_keys__) == set(types) - own
    for name, hint in FlatOptions.__annotations__.items():
        assert getattr(hint, "__forward_arg__", hint) == types[name], name
