"""The step's memory-bound work (issue #16 item 2) where it can be checked on CPU: batch copies,
the optimizer's fused kernel, and selective activation checkpointing."""

from argparse import Namespace

import torch

from hdp import model_preset
from launch.model import Llama
from launch.runtime import to_device
from launch.train import build_optimizer


def test_batch_copies_and_the_optimizer_keep_cpu_runs_as_they_were():
    t = torch.arange(5)
    assert to_device(t, torch.device("cpu")) is t  # no pinning, no copy off the GPU
    model = Llama(model_preset("tiny"))
    args = Namespace(lr=1e-3, weight_decay=0.1, warmup=1, steps=4, lr_decay_steps=None)
    optimizer, _ = build_optimizer(args, model=model)
    assert (
        optimizer.param_groups[0]["fused"] is None
    )  # fused only where every parameter is on a GPU
