"""Test scaffolding, not the library's API: tiny random-init models of the supported families
(`tiny`: also re-exported by `adacc_hf.assets` for the tests and benchmarks) and of every
transformers family the test suite runs (`families`). Offline: configs come from the installed
transformers."""
