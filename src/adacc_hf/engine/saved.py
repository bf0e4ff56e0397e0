"""The profiles a run saves beside its weights and checkpoints, read back by a later run
(`AdaccSession.reuse_profiles`)."""

from __future__ import annotations

import json
import logging
import os

from ..errors import PolicyError
from ..schema import Profile

logger = logging.getLogger("adacc_hf")

__all__ = ["PROFILES_FILE", "PROFILE_FILE", "read_profiles"]

PROFILE_FILE = "adacc_profile.json"  # the current plan's profile (a resumed run's)
PROFILES_FILE = "adacc_profiles.json"  # every bucket's profile, for a later run to reuse


def read_profiles(path: str, strict: bool = True) -> list[Profile]:
    """The profiles saved at `path`: an ``adacc_profiles.json`` or ``adacc_profile.json``, or a
    directory holding one (an earlier run's output directory or checkpoint); [] where there is
    none. An unreadable file (or one of a newer format) raises `PolicyError`; with
    ``strict=False`` (a directory looked into by default) it is skipped with a warning."""
    try:
        return _read(path)
    except (OSError, ValueError, TypeError, KeyError, PolicyError) as e:
        if strict:
            raise PolicyError(f"cannot read saved profiles at {path!r}: {e}") from None
        logger.warning("adacc: ignoring the saved profiles at %s (%s); profiling anew", path, e)
        return []


def _read(path: str) -> list[Profile]:
    if os.path.isdir(path):
        found = [os.path.join(path, n) for n in (PROFILES_FILE, PROFILE_FILE)]
        path = next((f for f in found if os.path.exists(f)), "")
    if not path or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    items = obj if isinstance(obj, list) else [obj]
    return [Profile.from_json(json.dumps(p)) for p in items]
