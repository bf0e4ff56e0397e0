"""Policies: the artifact (`Policy`), rule-based builders over a trace, and display."""

from ..schema import Action, GroupPolicy, OpSpec, Variant
from .core import Policy

__all__ = ["Action", "GroupPolicy", "OpSpec", "Policy", "Variant"]
