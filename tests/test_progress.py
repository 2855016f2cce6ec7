"""What a user sees while training: the step line, the first step's forecast, the data line and
the heartbeat of a long step."""

import time
from types import SimpleNamespace

import numpy as np

from hdp import ClusterSpec, CostModel, gpu_preset, model_preset
from hdp.launch.metrics import Heartbeat, clock, data_line, first_step_line, step_line
from hdp.planner import plan_step


def test_clock_is_hours_minutes_seconds():
    assert [clock(s) for s in (0, 59.6, 61, 3600 * 27 + 5)] == [
        "0:00:00",
        "0:01:00",
        "0:01:01",
        "27:00:05",
    ]


def test_the_step_line_shows_lr_grad_norm_memory_and_eta():
    record = {
        "step": 3,
        "loss": 2.5,
        "lr": 3e-4,
        "grad_norm": 0.75,
        "tokens_per_s": 1000.0,
        "mfu": 0.4,
        "peak_mem_bytes": [1.5e9, 2.5e9],
        "imbalance": 1.1,
        "comm_bytes": 2e6,
    }
    data = SimpleNamespace(plan_time_s=0.01, plan=SimpleNamespace(num_waves=2))
    line = step_line(record, data, elapsed=30.0, left=7, done=3)
    assert "lr 3.00e-04  grad norm 0.75" in line and "mem 2.50 GB" in line
    assert line.endswith("[0:00:30, ETA 0:01:10]")  # 10 s a step, 7 to go


def test_the_first_step_forecast_warns_of_a_step_over_an_hour():
    model, gpu = model_preset("tiny"), gpu_preset("cpu")
    cost = CostModel(model, ClusterSpec(4, 4, gpu), activation_checkpointing=True)
    plan = plan_step([1 << 22], cost.cluster, model, "hdp", cost=cost)  # days on 4 CPU ranks
    line = first_step_line(cost, SimpleNamespace(plan=plan), 1)
    assert line.startswith("step 1: 1 sequence, longest 4,194,304 tokens; predicted ")
    assert " GB per rank (of " in line
    assert "warning: this step is predicted to take over an hour" in line


def test_the_data_line_says_when_no_document_comes_near_max_seq():
    src = SimpleNamespace(name="a.jsonl", lengths=np.array([100, 0, 3000]))
    line = data_line([src], 1 << 20)
    assert line.startswith("data: a.jsonl (2 documents, 3,100 tokens); longest document 3,000")
    assert "no step holds a sequence near --max-seq 1,048,576" in line
    assert "note:" not in data_line([src], 4096)


def test_a_long_step_beats_against_its_prediction():
    lines = []
    with Heartbeat(lines.append, 7, predicted_s=0.1, every=0.05):
        time.sleep(0.33)
    assert len(lines) >= 3
    assert lines[0].startswith("step 7: 0:00:00 elapsed, ")
    assert "of the predicted 0:00:00" in lines[0]
    assert lines[-1].endswith("(past the prediction)")
