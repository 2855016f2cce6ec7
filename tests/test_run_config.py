"""The run's typed config: every flag lands in one field of one frozen section, the rules between
flags give new values instead of changing old ones, and the resume fingerprint keeps the fields
and values that checkpoints saved before the config was typed."""

import dataclasses
import importlib.metadata

import pytest

from hdp.launch.cli import parse_config
from hdp.launch.config import (
    SECTIONS,
    PlanningConfig,
    RunConfig,
    TrainingConfig,
    checked,
    choices,
)
from hdp.launch.flags import build_parser


def test_every_flag_is_one_field_of_one_section():
    parser = build_parser()
    flags = {a.dest for a in parser._actions if a.option_strings} - {"help", "config"}
    fields = [
        f.metadata.get("dest", f.name) for cls in SECTIONS.values() for f in dataclasses.fields(cls)
    ]
    assert sorted(fields) == sorted(flags)
    groups = [g.title for g in parser._action_groups]
    assert all(name in groups for name in SECTIONS)  # --help shows the sections


def test_the_config_is_frozen_and_resolving_makes_a_new_one():
    config = parse_config(["--max-seq", "4K"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.data.max_seq = 8192
    on = config.resolved(planning={"activation_checkpointing": True})
    assert on.planning.activation_checkpointing is True
    assert config.planning.activation_checkpointing is None and on.data is config.data


def test_the_fingerprint_has_the_fields_checkpoints_saved():
    """Written out by hand: the flags part of the fingerprint of a default run, as the untyped
    launcher saved it (a checkpoint of it must resume without --allow-changed-setup)."""
    config = parse_config(["--data-weights", "1,3", "--data", "a.jsonl", "--data", "b.jsonl"])
    assert config.fingerprint() == {
        "data": {
            "weights": [1.0, 3.0],
            "tokens_per_step": 65536,
            "max_seq": 16384,
            "seed": 0,
            "truncate": False,
        },
        "planning": {
            "strategy": "hdp",
            "sync": None,
            "capacity": None,
            "activation_checkpointing": None,
            "kv_exchange": "auto",
            "gpus_per_node": None,
        },
        "optimizer": {"lr": 3e-4, "warmup": 10, "weight_decay": 0.1, "grad_clip": 1.0},
    }


def test_rules_between_flags_fill_defaults_without_changing_what_was_given(tmp_path):
    config = parse_config(["--resume-step", "3", "--checkpoint-dir", str(tmp_path / "ck")])
    assert config.checkpointing.resume is True and config.checkpointing.resume_step == 3
    assert parse_config(["--max-seq", "1M"]).data.tokens_per_step == 1 << 20
    assert parse_config(["--keep-attention"]).planning.activation_checkpointing is True
    # --compile's default is the device's, resolved where training knows it.
    assert [parse_config(a).training.compile for a in ([], ["--compile"], ["--no-compile"])] == [
        None,
        True,
        False,
    ]
    assert isinstance(parse_config([]), RunConfig)


def test_hdp_train_is_the_installed_command():
    from hdp.launch.cli import run

    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="hdp-train")
    assert entry.load() is run


def test_hdp_train_errors_name_the_command(capsys):
    from hdp.launch.cli import main

    with pytest.raises(SystemExit):
        main(["--max-seq", "2M", "--tokens-per-step", "1M"], prog="hdp-train")
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("hdp-train: error: ")


def test_a_config_is_built_without_argparse_with_the_flags_defaults():
    from hdp.launch.flags import from_namespace

    parser = build_parser()
    assert checked(RunConfig()) == checked(from_namespace(parser.parse_args([]), parser))
    config = RunConfig(planning=PlanningConfig(sync="wave", kv_exchange="node"))
    assert config.planning.sync == "wave" and config.training.nan_policy == "stop"


def test_the_string_settings_take_the_names_of_what_they_choose():
    from hdp import BACKEND_NAMES, KV_EXCHANGES
    from hdp.planner import STRATEGIES

    assert choices(PlanningConfig, "strategy") == tuple(STRATEGIES)
    assert choices(TrainingConfig, "attention_backend") == ("auto", *BACKEND_NAMES)
    assert choices(PlanningConfig, "kv_exchange") == ("auto", *KV_EXCHANGES)
    assert choices(PlanningConfig, "sync") == ("wave", "peer")


@pytest.mark.parametrize(
    "section,field,flag",
    [
        (PlanningConfig, "sync", "--sync"),
        (PlanningConfig, "kv_exchange", "--kv-exchange"),
        (PlanningConfig, "strategy", "--strategy"),
        (TrainingConfig, "nan_policy", "--nan-policy"),
        (TrainingConfig, "attention_backend", "--attention-backend"),
        (TrainingConfig, "device", "--device"),
    ],
)
def test_a_string_setting_outside_its_values_is_refused_where_it_is_built(section, field, flag):
    with pytest.raises(ValueError, match=f"^{flag}: 'nope' is not one of "):
        section(**{field: "nope"})
    assert section(**{field: choices(section, field)[-1]})  # every value it lists is taken


def test_the_flags_offer_the_configs_values():
    parser = build_parser()
    for section, field in [(PlanningConfig, "sync"), (TrainingConfig, "device")]:
        (action,) = [a for a in parser._actions if a.dest == field]
        assert tuple(action.choices) == choices(section, field)


def test_hdp_search_flags_apply_to_hdp_only(capsys):
    config = parse_config(["--plan-budget", "0.5", "--max-ranks-per-seq", "4"])
    assert (config.planning.plan_budget, config.planning.max_ranks_per_seq) == (0.5, 4)
    assert "plan_budget" not in config.fingerprint()["planning"]  # checkpoints resume across it
    for flag, value in (("--plan-budget", "1"), ("--max-ranks-per-seq", "2")):
        with pytest.raises(SystemExit):
            parse_config(["--strategy", "static", flag, value])
        assert f"{flag} applies to --strategy hdp" in capsys.readouterr().err
