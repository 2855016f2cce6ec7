"""Shared test setup: the single-process tests compare float64 results too (see ``warm_up_exp``)."""

from hdp.testing.ranks import warm_up_exp

warm_up_exp()
