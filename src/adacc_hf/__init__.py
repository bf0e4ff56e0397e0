"""adacc-hf: Adacc (adaptive compression + recomputation of activations) for HuggingFace models."""

__version__ = "0.1.0"
