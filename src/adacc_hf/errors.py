"""Exceptions raised by adacc-hf. Every message says what to change."""

from __future__ import annotations


class AdaccError(RuntimeError):
    """Base class of every adacc-hf error."""


class UnsupportedModelError(AdaccError, ValueError):
    """The model family has no adapter."""


class PolicyError(AdaccError, ValueError):
    """A policy is malformed, corrupt, or does not match the model it is applied to."""


class AlreadyAppliedError(AdaccError):
    """`apply_adacc` was called on a model that is already patched."""


class BudgetError(AdaccError, ValueError):
    """A memory budget is malformed, or no policy fits in it."""


class AdaccFutureWarning(FutureWarning):
    """An old way of passing or reading an option that works for one more release: a fact of the
    run passed as an option, or an option read by its flat name off `AdaccConfig`."""
