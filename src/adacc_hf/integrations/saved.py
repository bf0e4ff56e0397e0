"""The profiles a run saves beside its weights and checkpoints, read back by a later run
(`AdaccSession.reuse_profiles`)."""

from __future__ import annotations

import json
import os

from ..schema import Profile

__all__ = ["PROFILES_FILE", "PROFILE_FILE", "read_profiles"]

PROFILE_FILE = "adacc_profile.json"  # the current plan's profile (a resumed run's)
PROFILES_FILE = "adacc_profiles.json"  # every bucket's profile, for a later run to reuse


def read_profiles(path: str) -> list[Profile]:
    """The profiles saved at `path`: an ``adacc_profiles.json`` or ``adacc_profile.json``, or a
    directory holding one (an earlier run's output directory or checkpoint); [] where there is
    none. Profiles of a newer format raise `PolicyError`."""
    if os.path.isdir(path):
        found = [os.path.join(path, n) for n in (PROFILES_FILE, PROFILE_FILE)]
        path = next((f for f in found if os.path.exists(f)), "")
    if not path or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    items = obj if isinstance(obj, list) else [obj]
    return [Profile.from_json(json.dumps(p)) for p in items]
