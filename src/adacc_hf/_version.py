"""The version of adacc-hf (one home: pyproject reads it, artifacts record it)."""

__version__ = "0.1.0"
