"""The learning-rate schedule: one rule for warm-up against the decay horizon, given or implied,
and a resumed run that keeps its saved schedule unless told otherwise."""

import pytest

from hdp.launch.config import OptimizerConfig
from hdp.launch.schedule import Schedule, run_schedule


def flags(steps=20, warmup=10, lr_decay_steps=None):
    """(the optimizer section of ``--warmup warmup --lr-decay-steps ...``, ``--steps``)"""
    optimizer = OptimizerConfig(3e-4, warmup, lr_decay_steps, 0.1, 1.0)
    return optimizer, steps


def test_the_factor_warms_up_linearly_then_decays_by_a_cosine_to_a_tenth():
    s = Schedule(warmup=4, decay_steps=14)
    assert [s.factor(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]  # steps 1-4
    assert s.factor(4) < 1.0  # the peak is held for one step only
    assert s.factor(8) == pytest.approx(0.55)  # step 9, half-way: (1 + 0.1) / 2
    assert s.factor(13) == pytest.approx(0.1)  # step 14 is the first at the floor
    assert s.factor(12) > 0.1 and s.factor(100) == pytest.approx(0.1)


def test_a_run_ends_at_the_floor_its_log_announces():
    """Steps 1-12 with a warm-up of 10: the last trains at 10% of --lr (it trained at 55%)."""
    s = Schedule(warmup=10, decay_steps=12)
    assert s.factor(11) == pytest.approx(0.1) and s.factor(10) == pytest.approx(0.55)


@pytest.mark.parametrize("given", [{"steps": 4}, {"steps": 20, "lr_decay_steps": 4}])
def test_a_warm_up_past_the_horizon_ends_there_whether_the_horizon_is_given_or_implied(given):
    lines = []
    assert run_schedule(*flags(**given), None, lines.append) == Schedule(4, 4)
    assert lines == ["warm-up of 4 steps, not --warmup 10: it ends where the decay does, at step 4"]


def test_an_extended_run_continues_its_saved_schedule_and_says_so():
    lines = []
    saved = {"warmup": 10, "decay_steps": 20}
    assert run_schedule(*flags(steps=30), saved, lines.append) == Schedule(10, 20)
    assert lines[0].startswith("continuing the saved schedule: its decay ends at step 20")
    assert run_schedule(*flags(steps=20), saved, pytest.fail) == Schedule(10, 20)


def test_lr_decay_steps_moves_the_horizon_of_a_resumed_run():
    lines = []
    saved = {"warmup": 10, "decay_steps": 20}
    assert run_schedule(*flags(steps=30, lr_decay_steps=30), saved, lines.append) == Schedule(
        10, 30
    )
    assert lines == [
        "the learning-rate decay now ends at step 30 (--lr-decay-steps), not at step 20 as saved"
    ]
