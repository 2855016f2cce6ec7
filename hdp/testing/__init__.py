"""Helpers for hdp's tests and benchmarks: N gloo ranks in fresh processes (:mod:`.ranks`) and
tiny Hugging Face checkpoints written by transformers itself (:mod:`.hf_models`, which needs the
``dev`` extra). Nothing in the library imports this package."""
