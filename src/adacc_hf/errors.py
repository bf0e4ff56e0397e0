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
