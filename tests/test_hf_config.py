"""Model architectures from transformers' config.json: real models' configs read into the shapes of
hdp's presets, both RoPE spellings read alike, RoPE frequencies bit-equal to transformers', and
one line naming the field for every config hdp cannot train."""

import copy
import json

import pytest
import torch

from hdp import ConfigError, model_preset
from hdp.hf_config import shape_differences, spec_of

transformers = pytest.importorskip("transformers")

# config.json of real checkpoints as published (transformers 4.x spelling), trimmed to the
# fields a model's shape and RoPE depend on plus a few that must be ignored.
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "pretraining_tp": 1,
    "torch_dtype": "bfloat16",
}
LLAMA32_1B = {
    **LLAMA31_8B,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "head_dim": 64,
    "tie_word_embeddings": True,
    "rope_scaling": {**LLAMA31_8B["rope_scaling"], "factor": 32.0},
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "max_window_layers": 28,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32768,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "attention_bias": False,
    "sliding_window": None,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


@pytest.mark.parametrize(
    "config, preset",
    [
        (LLAMA31_8B, "llama3.1-8b"),
        (LLAMA32_1B, "llama-1b"),
        (QWEN25_7B, "qwen2.5-7b"),
        (MISTRAL_7B_V03, "mistral-7b"),
        (QWEN3_8B, "qwen3-8b"),
    ],
)
def test_real_configs_read_as_the_presets(config, preset):
    spec, expected = spec_of(config), model_preset(preset)
    assert shape_differences(spec, expected) == []
    assert (spec.rope, spec.norm_eps) == (expected.rope, expected.norm_eps)
    # transformers' own count of the parameters
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**copy.deepcopy(config))  # it edits nested dicts
        )
    assert spec.total_params == sum(p.numel() for p in model.parameters())


def test_both_rope_spellings_read_alike(tmp_path):
    old = copy.deepcopy(LLAMA31_8B)
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_theta": 500000.0, **old["rope_scaling"]}
    spelled_type = copy.deepcopy(old)
    spelled_type["rope_scaling"]["type"] = spelled_type["rope_scaling"].pop("rope_type")
    specs = [spec_of(c) for c in (old, new, spelled_type)]
    assert specs[0] == specs[1] == specs[2]
    (tmp_path / "config.json").write_text(json.dumps(new))
    assert spec_of(tmp_path).rope == specs[0].rope  # a directory
    assert spec_of(tmp_path / "config.json").name == tmp_path.name


ROPES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "original_max_position_embeddings": 4096,
    },
    {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
        "attention_factor": 1.3,
    },
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_frequencies_equal_transformers(rope, head_dim):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from hdp.launch.rope import rope_frequencies

    fields = {**LLAMA31_8B, "head_dim": head_dim, "max_position_embeddings": 32768}
    fields.pop("rope_scaling")
    fields.pop("rope_theta")
    config = transformers.LlamaConfig(**fields, rope_parameters=dict(rope))
    theirs = LlamaRotaryEmbedding(config)
    spec = spec_of({**fields, "rope_parameters": dict(rope)})
    inv_freq, scale = rope_frequencies(spec.rope, head_dim)
    assert torch.equal(inv_freq, theirs.inv_freq)
    assert scale == pytest.approx(theirs.attention_scaling, rel=1e-15)


def _refused(config, *fields):
    with pytest.raises(ConfigError) as e:
        spec_of(config)
    message = str(e.value)
    assert "\n" not in message
    for field in fields:
        assert field in message, message


@pytest.mark.parametrize(
    "change, named",
    [
        ({"model_type": "mixtral"}, "model_type 'mixtral'"),
        ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe'"),
        ({"model_type": "deepseek_v3"}, "model_type 'deepseek_v3'"),
        ({"model_type": None}, "model_type None"),
        ({"num_local_experts": 8}, "num_local_experts"),
        ({"kv_lora_rank": 512}, "kv_lora_rank"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"num_key_value_heads": 5}, "num_key_value_heads 5"),
        ({"hidden_size": "4096"}, "hidden_size"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'"),
        ({"rope_scaling": {"rope_type": "linear"}}, "'factor'"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "'factor'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2, "beta_fast": 3}}, "'beta_fast'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, "factor"),
        ({"partial_rotary_factor": 0.5, "rope_scaling": None}, "partial_rotary_factor"),
        ({"rope_theta": float("inf")}, "rope_theta"),
        ({"rope_theta": 1e-300}, "rope_theta must be above 1"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 1, "beta_slow": 32}},
            "beta_fast 1 must be above beta_slow 32",
        ),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
        ({"attention_bias": "false"}, "attention_bias must be true or false"),
        ({"pad_token_id": True}, "pad_token_id True"),
        ({"head_dim": 0}, "head_dim must be a whole number"),
        ({"head_dim": 13}, "head_dim 13 is odd"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a whole number"),
        ({"vocab_size": 2**70}, "vocab_size must be a whole number from 1 to"),
        ({"max_position_embeddings": "abc"}, "max_position_embeddings must be"),
        (
            {"rope_scaling": {"type": "linear", "rope_type": "yarn", "factor": 2.0}},
            "type 'linear' and rope_type 'yarn' disagree",
        ),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "default"}}, "rope_scaling": None},
            "rope_parameters per layer type",
        ),
    ],
)
def test_configs_hdp_cannot_train_are_refused_naming_the_field(change, named, tmp_path):
    config = {**LLAMA31_8B, **change}
    _refused(config, named)
    (tmp_path / "config.json").write_text(json.dumps(config))
    _refused(tmp_path, named, str(tmp_path / "config.json"))


def test_sliding_windows_are_refused_where_set():
    _refused({**MISTRAL_7B_V03, "sliding_window": 4096}, "sliding_window 4096")
    mistral = {k: v for k, v in MISTRAL_7B_V03.items() if k != "sliding_window"}
    _refused(mistral, "sliding_window 4096")  # transformers' default for mistral
    _refused({**QWEN25_7B, "use_sliding_window": True}, "use_sliding_window")
    _refused({**QWEN3_8B, "layer_types": ["sliding_attention"] * 36}, "layer_types")
    assert spec_of(QWEN25_7B).architecture == "qwen2"  # window set, not used


def test_missing_fields_are_named_and_defaults_are_transformers():
    _refused({k: v for k, v in LLAMA31_8B.items() if k != "hidden_size"}, "lacks hidden_size")
    qwen3 = {k: v for k, v in QWEN3_8B.items() if k not in ("head_dim", "rms_norm_eps")}
    spec = spec_of(qwen3)
    assert (spec.head_dim, spec.norm_eps) == (128, 1e-6)


def test_a_config_file_that_is_not_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not JSON"):
        spec_of(tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        spec_of(tmp_path / "missing")
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="config.json: not a regular file"):
        spec_of(tmp_path / "config.json")


def test_sim_and_plan_take_a_config_json(tmp_path, capsys):
    from hdp.planner.cli import plan_main, sim_main

    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    (tmp_path / "lengths.txt").write_text("100000\n30000\n5000\n")
    args = ["--gpus", "16", "--model", str(tmp_path / "config.json")]
    assert (
        plan_main(
            [
                "--lengths",
                str(tmp_path / "lengths.txt"),
                *args,
                "--out",
                str(tmp_path / "plan.json"),
            ]
        )
        == 0
    )
    assert (
        sim_main(
            [
                "--workload",
                "wlb-128k",
                *args,
                "--steps",
                "1",
                "--strategies",
                "static,hdp",
                "--json",
                str(tmp_path / "sim.json"),
            ]
        )
        == 0
    )
    config = json.loads((tmp_path / "sim.json").read_text())["config"]
    assert config["model"] == tmp_path.name
