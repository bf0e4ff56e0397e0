"""Policies are stable, serialisable artifacts; bad files fail with a clear message."""

from __future__ import annotations

import copy
import json
import pickle

import pytest
from conftest import random_policy

from adacc_hf import Action, Policy, PolicyError, assets, layer_type_policy, uniform_policy


@pytest.fixture(scope="module")
def policy():
    model = assets.tiny_model("t5")
    return random_policy(
        model, assets.tiny_batch("t5", model), seed=4, kinds=("retain", "recompute", "compress")
    )


def test_json_round_trip_copy_deepcopy_and_pickle_are_equal(policy):
    text = policy.to_json()
    assert text == policy.to_json()  # stable
    assert json.loads(text) == json.loads(json.dumps(json.loads(text), sort_keys=True))
    for other in (
        Policy.from_json(text),
        copy.copy(policy),
        copy.deepcopy(policy),
        pickle.loads(pickle.dumps(policy)),
    ):
        assert other == policy
        assert other.to_dict() == policy.to_dict()
        assert other.fingerprint() == policy.fingerprint()


def test_save_and_load_file(policy, tmp_path):
    path = tmp_path / "adacc_policy.json"
    policy.save(str(path))
    assert Policy.load(str(path)) == policy


def test_fingerprint_changes_with_actions_not_metadata(policy):
    other = copy.deepcopy(policy)
    other.metadata["note"] = "x"
    assert other.fingerprint() == policy.fingerprint()
    g = next(iter(other.groups.values()))
    key = next(k for k, a in g.variants[0].actions.items() if a.kind != "recompute")
    g.variants[0].actions[key] = Action.recompute()
    assert other.fingerprint() != policy.fingerprint()


def _mutated(policy, fn):
    d = json.loads(policy.to_json())
    fn(d)
    return json.dumps(d)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.pop("groups"), "corrupt adacc policy"),
        (lambda d: d.pop("adacc_hf_policy_format"), "not an adacc-hf policy"),
        (lambda d: d.update(adacc_hf_policy_format=99), "newer adacc-hf"),
        (lambda d: d.update(groups={}), "no block groups"),
        (
            lambda d: next(iter(d["groups"].values()))["variants"][0]["actions"].update(
                {"nope/mm#0": "retain"}
            ),
            "unknown ops",
        ),
        (
            lambda d: next(iter(d["groups"].values()))["variants"][0]["actions"].update(
                {next(iter(d["groups"].values()))["ops"][0]["key"]: {"compress": "zip9"}}
            ),
            "unknown codec",
        ),
        (
            lambda d: next(iter(d["groups"].values()))["variants"][0]["actions"].update(
                {next(iter(d["groups"].values()))["ops"][0]["key"]: "keep"}
            ),
            "unknown action",
        ),
        (lambda d: next(iter(d["groups"].values()))["ops"][0].pop("shape"), "corrupt"),
        (lambda d: d.pop("adapter"), "'adapter' is missing"),
        (lambda d: d.update(adapter=3), "'adapter' must be a str"),
        (lambda d: d.update(adapter_version="1"), "'adapter_version' must be a int"),
        (lambda d: d.update(adapter_version=True), "'adapter_version' must be a int"),
        (lambda d: d.update(library_version=0.1), "'library_version' must be a str"),
        (lambda d: d.update(head=None), "'head' must be a str"),
        (lambda d: d.update(head="sliced"), "unknown head"),
        (lambda d: d.update(metadata=[]), "'metadata' must be a dict"),
        (lambda d: d.update(model_type=None), "'model_type' must be a str"),
    ],
)
def test_corrupt_policies_raise_clear_errors(policy, edit, message):
    with pytest.raises(PolicyError, match=message):
        Policy.from_json(_mutated(policy, edit))


def test_not_json_and_missing_file_raise_policy_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(PolicyError, match="not valid JSON"):
        Policy.load(str(bad))
    with pytest.raises(PolicyError, match="cannot read policy file"):
        Policy.load(str(tmp_path / "missing.json"))
    bad.write_text("[1, 2]")
    with pytest.raises(PolicyError, match="JSON object"):
        Policy.load(str(bad))


def test_ops_mutated_after_use_can_only_be_recomputed():
    """Random ops (dropout masks, attention with dropout) are cacheable: the runtime replays their
    RNG. An output written in place after it was read is not (T5's relative-position buckets)."""
    model = assets.tiny_model("t5")
    policy = uniform_policy(model, "recompute")
    group = policy.groups["encoder_first"]
    fixed = [o for o in group.ops if not o.cacheable]
    assert fixed, "tiny T5's bucket computation should produce a non-cacheable op"
    assert any(o.mask and o.cacheable for o in group.ops), "CPU dropout masks are cacheable"
    group.variants[0].actions[fixed[0].key] = Action.retain()
    with pytest.raises(PolicyError, match="can only be recomputed"):
        policy.check()


def test_unknown_keys_from_newer_versions_are_dropped_with_a_warning(policy):
    text = _mutated(policy, lambda d: d.update(future_field=1))
    with pytest.warns(UserWarning, match="future_field"):
        assert Policy.from_json(text) == policy


def test_table_lists_every_op_with_its_action(policy):
    table = policy.table()
    for name, g in policy.groups.items():
        assert f"[{name}]" in table
        for op in g.ops:
            assert op.key in table
    assert "compress:" in table and "retain" in table and "recompute" in table
    summary = policy.summary()
    assert set(summary) == set(policy.groups)


def test_bad_actions_and_layer_types_are_rejected():
    with pytest.raises(PolicyError, match="needs a codec"):
        Action("compress")
    with pytest.raises(PolicyError, match="unknown action"):
        uniform_policy(assets.tiny_model("gpt2"), "keep")  # type: ignore[arg-type]
    with pytest.raises(PolicyError, match="unknown layer types"):
        layer_type_policy(assets.tiny_model("gpt2"), {"attention": "recompute"})
