"""Triton kernels for the adacc-hf codecs (issue 3); the torch references live in adacc_hf.codecs."""
