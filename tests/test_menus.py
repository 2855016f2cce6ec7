"""Degree menus: the coarse pass that stops where heights rise for good (Note [Heights past a
node] in :mod:`hdp.planner.menus`), over many lengths at once, gives the menus that pricing every
coarse degree of one length at a time gives."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hdp import ClusterSpec, CostModel, model_preset
from hdp.planner import menus


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
        lengths = np.exp(rng.uniform(np.log(4_000), np.log(2_000_000), 4)).astype(int).tolist()
        # (The Megatron form's menus, ``pow2``, stop by the same rule.)
        for floor_s, pow2 in [(0.0, False), (1.0, False), (0.0, True)]:
            got = menus._new_menus(cost, lengths, sync, cap, pow2, floor_s, True)  # all at once
            for length, menu in zip(lengths, got):
                with monkeypatch.context() as m:
                    m.setattr(menus, "_coarse_done", lambda *args: False)
                    m.setattr(menus, "_MENUS", {})
                    want = menus._new_menus(cost, [length], sync, cap, pow2, floor_s, True)[0]
                for name in menus.Menu.__dataclass_fields__:
                    assert np.array_equal(getattr(menu, name), getattr(want, name)), (
                        f"{model} on {ranks} {profile} ranks, {exchange} exchange, {sync} sync: "
                        f"a {length}-token menu's {name} differs"
                    )
