"""What a run leaves on disk: the policy, profile and tracking state beside the weights and in
every checkpoint, a short section and a tag in the model card, a small entry in ``config.json``."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..engine.saved import PROFILE_FILE, PROFILES_FILE
from ..policy import Policy
from ..policy.display import card_section, config_summary
from ..schema import Profile

if TYPE_CHECKING:
    from ..engine.session import AdaccSession

POLICY_FILE = "adacc_policy.json"
STATE_FILE = "adacc_state.json"
CARD_TAG = "adacc-hf"
_SECTION_START = "<!-- adacc-hf:start -->"
_SECTION_END = "<!-- adacc-hf:end -->"


def write_artifacts(directory: str, session: AdaccSession) -> None:
    """Policy, profile and tracking state of `session` into `directory`."""
    os.makedirs(directory, exist_ok=True)
    if session.policy is not None:
        session.policy.save(os.path.join(directory, POLICY_FILE))
    if session.profile is not None:
        with open(os.path.join(directory, PROFILE_FILE), "w", encoding="utf-8") as f:
            f.write(session.profile.to_json() + "\n")
    if session.profiles:
        with open(os.path.join(directory, PROFILES_FILE), "w", encoding="utf-8") as f:
            f.write("[\n" + ",\n".join(p.to_json() for p in session.profiles.values()) + "\n]\n")
    with open(os.path.join(directory, STATE_FILE), "w", encoding="utf-8") as f:
        json.dump(session.state_dict(), f, indent=2, sort_keys=True)


def read_artifacts(directory: str) -> tuple[Policy | None, Profile | None, dict[str, Any]]:
    """What `write_artifacts` wrote (missing files give None / {})."""
    policy = profile = None
    state: dict[str, Any] = {}
    path = os.path.join(directory, POLICY_FILE)
    if os.path.exists(path):
        policy = Policy.load(path)
    path = os.path.join(directory, PROFILE_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            profile = Profile.from_json(f.read())
    path = os.path.join(directory, STATE_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
    return policy, profile, state


def update_model_card(directory: str, policy: Policy, measured_peak_nbytes: int | None = None):
    """Add the ``adacc-hf`` tag and the policy section to ``directory/README.md`` (created if
    missing); a section written before is replaced."""
    from huggingface_hub import ModelCard

    path = os.path.join(directory, "README.md")
    card = ModelCard.load(path) if os.path.exists(path) else ModelCard("---\n---\n")
    tags = list(card.data.tags or [])
    if CARD_TAG not in tags:
        card.data.tags = [*tags, CARD_TAG]
    text = card.text
    if _SECTION_START in text:
        head, _, rest = text.partition(_SECTION_START)
        text = head + rest.partition(_SECTION_END)[2]
    section = card_section(policy, measured_peak_nbytes)
    card.text = f"{text.rstrip()}\n\n{_SECTION_START}\n{section}{_SECTION_END}\n"
    card.save(path)
    return card


@contextlib.contextmanager
def config_entry(config: Any, policy: Policy | None) -> Iterator[None]:
    """``config.adacc`` = a small summary while the config is saved, then removed again (the live
    config is shared with models derived from it)."""
    if config is None or policy is None:
        yield
        return
    had, old = hasattr(config, "adacc"), getattr(config, "adacc", None)
    config.adacc = config_summary(policy)
    try:
        yield
    finally:
        if had:
            config.adacc = old
        else:
            with contextlib.suppress(AttributeError):
                del config.adacc
