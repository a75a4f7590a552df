"""A config.json checked before anything is built (memlab.hf.config_check), the bound before a
long simulation (memlab.hf.simulation_bound), through the command line as a learner meets them.
Expected values come from transformers' own config classes (their dataclass defaults) and
from the issue's hostile files."""
import dataclasses
import io
import json

import pytest

pytest.importorskip("transformers")

from memlab.app.cli import main  # noqa: E402
from memlab.core.errors import InputError  # noqa: E402
from memlab.hf import config as hf  # noqa: E402
from memlab.hf import simulation_bound
from memlab.hf.config_check import FIELDS, FIXED_DEFAULTS, check_config  # noqa: E402
from memlab.hf.simulate import simulate_hf  # noqa: E402

SMALL = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
FAMILIES = [  # today's architectures' own fields, small
    SMALL,
    dict(SMALL, model_type="qwen3", head_dim=48),
    dict(SMALL, model_type="gemma2", head_dim=32, sliding_window=64, query_pre_attn_scalar=32),
    dict(SMALL, model_type="gemma3_text", head_dim=48, sliding_window=64, num_key_value_heads=1),
    dict(SMALL, model_type="phi3", num_key_value_heads=4),
    dict(SMALL, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    dict(SMALL, model_type="qwen3_moe", moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    dict(SMALL, model_type="deepseek_v3", moe_intermediate_size=32, num_hidden_layers=3, n_routed_experts=8,
         n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
         q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32),
    dict(SMALL, model_type="gpt_oss", head_dim=32, num_local_experts=4, num_experts_per_tok=2,
         sliding_window=64),
    dict(model_type="gpt2", vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256),
]


@pytest.mark.parametrize("cfg", FAMILIES, ids=lambda c: c["model_type"])
def test_todays_architectures_pass_and_fill_as_transformers_does(cfg):
    checked = check_config(cfg, construct=True)
    from transformers import AutoConfig
    kind = cfg["model_type"]
    raw = AutoConfig.for_model(kind, **{k: v for k, v in cfg.items() if k != "model_type"})
    filled = AutoConfig.for_model(kind, **{k: v for k, v in checked.config.items() if k != "model_type"})
    assert filled.to_dict() == raw.to_dict()  # the defaults written in are the class's own


@pytest.mark.parametrize("name", sorted(hf.SHIPPED))
def test_shipped_configs_pass_unchanged(name):
    cfg = hf.load_config(name, checked=False)
    assert check_config(cfg, construct=True).config == cfg | check_config(cfg, construct=True).config


@pytest.mark.parametrize("change, needle", [
    ({"hidden_size": -5}, "hidden_size=-5; allowed: an integer 1-2147483647"),
    ({"hidden_size": 100, "num_attention_heads": 7, "num_key_value_heads": 3},
     "num_attention_heads=7 does not divide hidden_size=100; allowed: a divisor of 100 (1, 2, 4, 5, 10"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4; allowed: "
                                 "a divisor of 4 (1, 2, 4)"),
    ({"num_hidden_layers": 2.0}, "num_hidden_layers=2.0; allowed: an integer"),
    ({"vocab_size": True}, "vocab_size=True; allowed: an integer"),
    ({"vocab_size": 2**31}, "vocab_size=2147483648; allowed: an integer 1-2147483647"),
    ({"rope_theta": float("nan")}, "rope_theta=nan; allowed: a finite number > 0"),
    ({"rope_scaling": "yarn"}, "rope_scaling='yarn'; allowed: an object"),
    ({"rope_scaling": {"factor": -1}}, "rope_scaling.factor=-1; allowed: a finite number > 0"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings='no'; allowed: true or false"),
    ({"architectures": 5}, "architectures=5; allowed: a non-empty list of strings"),
    ({"num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds the 4 experts"),
    ({"n_routed_experts": 6, "n_group": 4}, "n_group=4 does not divide the 6 routed experts"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries for num_hidden_layers=2"),
    ({"n_embd": 32, "hidden_size": 64}, "these spell one field"),
    ({"model_type": "__import__('os').system('x')"}, "model_type=\"__import__('os').system('x')\"; allowed: a"),
    ({"model_type": "no_such_model"}, "model_type 'no_such_model' is unknown to transformers"),
])
def test_a_bad_field_is_named_with_its_value_and_what_is_allowed(change, needle):
    with pytest.raises(InputError) as e:
        check_config(dict(SMALL, **change), construct=True)
    assert needle in str(e.value)


def test_a_partial_config_names_the_defaulted_fields_with_the_classs_values():
    from transformers import LlamaConfig
    defaults = {f.name: f.default for f in dataclasses.fields(LlamaConfig)}
    checked = check_config({"model_type": "llama", "hidden_size": 512})
    for name in ("vocab_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "max_position_embeddings"):
        assert checked.defaulted[name] == defaults[name] == checked.config[name]
        assert f"{name}={defaults[name]}" in checked.note
    assert "hidden_size" not in checked.defaulted
    assert "LlamaConfig" in checked.note


def test_fixed_defaults_shortcut_holds_for_the_classes():
    """FIXED_DEFAULTS lets an estimate skip transformers: given the core fields and those
    listed, every other field memlab reads is a bool or one the class computes (None)."""
    from transformers import CONFIG_MAPPING
    for kind, listed in FIXED_DEFAULTS.items():
        defaults = {f.name: f.default for f in dataclasses.fields(CONFIG_MAPPING[kind])}
        left = [f.name for f in FIELDS if not f.core and f.noted and f.kind != "bool"
                and f.name not in listed and f.name != "intermediate_size"
                and isinstance(defaults.get(f.name), (int, float)) and not isinstance(defaults[f.name], bool)]
        assert left == [], kind


def _cli(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


HOSTILE = {
    "huge": dict(model_type="llama", hidden_size=1_000_000, num_hidden_layers=100_000, num_attention_heads=8,
                 intermediate_size=2_000_000, vocab_size=32000, max_position_embeddings=4096),
    "deep": dict(SMALL, num_hidden_layers=100_000),
    "negative": dict(SMALL, hidden_size=-5),
    "heads": dict(SMALL, hidden_size=100, num_attention_heads=7, num_key_value_heads=3),
    "code": dict(SMALL, model_type="__import__('os').system('echo pwned')"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(HOSTILE))
@pytest.mark.parametrize("command", ["estimate", "simulate"])
def test_the_issues_hostile_files_end_in_a_result_or_one_line(name, command, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(HOSTILE[name]))
    rc, out, err = _cli([command, "--hf-config", str(tmp_path), "--seq", "64", "--batch", "1"], capsys)
    expected = 0 if (command, name) in (("estimate", "huge"), ("estimate", "deep")) else 2
    assert rc == expected, err
    if rc == 2:
        assert err.startswith("memlab: error: ") and err.count("\n") == 1
    if (command, name) == ("estimate", "huge"):
        assert "EiB" in out and "more than any card" in out
    if (command, name) == ("simulate", "deep"):  # under 64-bit bytes, past the time bound
        assert "--allow-long" in err and "the estimate's peak" in err and "300 s" in err


def test_a_partial_config_simulated_says_its_defaults(tmp_path, capsys):
    cfg = {k: v for k, v in SMALL.items() if k != "vocab_size"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, err = _cli(["simulate", "--hf-config", str(tmp_path), "--seq", "16", "--batch", "1",
                         "--target", "cpu"], capsys)
    assert rc == 0, err
    assert "left to transformers' defaults (LlamaConfig)" in out and "vocab_size=32000" in out


def test_a_deeply_nested_file_is_bad_json_not_a_crash(tmp_path, capsys):
    (tmp_path / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    rc, _, err = _cli(["estimate", "--hf-config", str(tmp_path)], capsys)
    assert rc == 2 and "not valid JSON" in err


def test_the_bound_predicts_from_layers_and_tokens():
    b = simulation_bound.simulation_bound(dict(SMALL, num_hidden_layers=1000), seq=64, batch=2)
    assert b.seconds == pytest.approx(simulation_bound.SECONDS_BASE + 1000 * (
        simulation_bound.SECONDS_PER_LAYER + 128 * simulation_bound.SECONDS_PER_LAYER_TOKEN))
    assert b.estimate_bytes is not None and b.refusal() is not None
    simulation_bound.check_bound(b, allow_long=True)  # the flag goes on
    with pytest.raises(InputError, match="--allow-long"):
        simulation_bound.check_bound(b)


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_a_terminal_or_when_asked():
    long = simulation_bound.SimulationBound(layers=80, tokens=1, seconds=60, params=1, estimate_bytes=None)
    short = dataclasses.replace(long, seconds=3)
    assert not simulation_bound.wants_progress(long, False, io.StringIO())  # pytest, nbval
    assert simulation_bound.wants_progress(long, False, _Tty())
    assert not simulation_bound.wants_progress(short, False, _Tty())
    assert simulation_bound.wants_progress(short, True, io.StringIO())


def test_progress_bar_counts_each_layers_forward_and_backward():
    stream = io.StringIO()
    with simulation_bound.progress(2, stream=stream) as bar:
        simulate_hf(SMALL, seq=16, batch=1, target="cpu")
        assert bar.n == 4  # 2 layers forward, 2 backward
    assert "simulate" in stream.getvalue()
