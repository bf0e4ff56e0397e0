"""What adacc-hf says while it works, and how to turn it up or down.

The ``adacc_hf`` logger shows INFO by default (one line per plan, profiling and take-over notes;
the per-op policy table is DEBUG), on stderr. ``ADACC_VERBOSITY`` (``debug``,
``info``, ``warning``, ``error``) or `set_verbosity` changes the level. Where the application has
configured logging itself (a handler on the root logger), records go there by propagation and the
library's own handler stays silent, so nothing prints twice.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

__all__ = ["ENV", "LOGGER", "progress", "set_verbosity"]

ENV = "ADACC_VERBOSITY"
LOGGER = logging.getLogger("adacc_hf")
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


class _Handler(logging.StreamHandler):
    """stderr, unless the root logger has handlers of its own (then they show the record)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def set_verbosity(level: int | str) -> None:
    """Set the ``adacc_hf`` logger's level (the default: ``ADACC_VERBOSITY``, else info).

    Args:
        level: a `logging` level or ``"debug"`` / ``"info"`` / ``"warning"`` / ``"error"``.

    Raises:
        ValueError: an unknown level name.
    """
    if isinstance(level, str):
        if level.lower() not in _LEVELS:
            raise ValueError(f"verbosity must be one of {', '.join(_LEVELS)}, not {level!r}")
        level = _LEVELS[level.lower()]
    LOGGER.setLevel(level)


def install() -> None:
    """Give the library's logger its default handler and level (once)."""
    if any(isinstance(h, _Handler) for h in LOGGER.handlers):
        return
    handler = _Handler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))  # messages say "adacc"
    LOGGER.addHandler(handler)
    env = os.environ.get(ENV, "info").lower()
    LOGGER.setLevel(_LEVELS.get(env, logging.INFO))
    if env not in _LEVELS:
        LOGGER.warning("%s=%r is not one of %s: adacc logs at info", ENV, env, ", ".join(_LEVELS))
    # bitsandbytes, which transformers imports with the Trainer, warns on every CPU import that
    # its optional `kernels` hub package is missing (a CPU 4-bit kernel adacc never uses): the
    # first line a CPU user would see. Left alone where the application set that logger's level.
    quiet = logging.getLogger("bitsandbytes.backends.cpu.ops")
    if quiet.level == logging.NOTSET:
        quiet.setLevel(logging.ERROR)


def progress(total: int, desc: str) -> Any:
    """A progress bar (tqdm, as the Trainer's) for work that may take a while: shown on stderr
    after 3 s, where the logger shows INFO and on the first rank only; ``update(1)`` per part,
    ``set_description`` for what it measures now, ``close()`` at the end."""
    from tqdm.auto import tqdm

    rank = int(os.environ.get("RANK", "0") or 0)
    quiet = not LOGGER.isEnabledFor(logging.INFO) or rank != 0
    return tqdm(total=total, desc=desc, delay=3, leave=False, disable=quiet, file=sys.stderr)
