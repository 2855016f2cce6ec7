"""Degree menus: the coarse pass that stops where heights rise for good (Note [Heights past a
node] in :mod:`hdp.planner.menus`) gives the menus that pricing every coarse degree gives."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hdp import ClusterSpec, CostModel, model_preset
from hdp.planner import menus


def _every_coarse_degree(cost, length, sync, candidates, floor_s):
    return menus._priced(cost, length, sync, candidates, False, False)


@pytest.mark.parametrize(
    "profile,exchange",
    list(itertools.product(["h100", "a100-80g", "cpu"], ["rank", "node", "ulysses"])),
)
def test_menus_match_pricing_every_coarse_degree(monkeypatch, profile, exchange):
    rng = np.random.default_rng(7)
    for ranks, model, sync in itertools.product(
        [64, 4096], ["llama-7b", "llama-70b"], ["peer", "wave"]
    ):
        cost = CostModel(
            model_preset(model), ClusterSpec.preset(profile, ranks), kv_exchange=exchange
        )
        cap = cost.capacity(sync)
        lengths = np.exp(rng.uniform(np.log(4_000), np.log(2_000_000), 3)).astype(int)
        for length, floor_s in itertools.product(lengths.tolist(), [0.0, 1.0]):
            got = menus.length_menu.__wrapped__(cost, length, sync, cap, False, floor_s)
            with monkeypatch.context() as m:
                m.setattr(menus, "_coarse", _every_coarse_degree)
                want = menus.length_menu.__wrapped__(cost, length, sync, cap, False, floor_s)
            for name in menus.Menu.__dataclass_fields__:
                assert np.array_equal(getattr(got, name), getattr(want, name)), (
                    f"{model} on {ranks} {profile} ranks, {exchange} exchange, {sync} sync: "
                    f"a {length}-token menu's {name} differs"
                )
