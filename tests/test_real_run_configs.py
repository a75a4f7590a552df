"""The run readers on real files from public repositories (tests/data/run_configs/index.json
names each file's repository, path and commit, and what the source says of its own run).

Each answer is checked against the file's own keys (the reading) and, where the source
states something about its run (it fits on the stated cards, or it does not), against that;
or it is a one-line refusal naming the field. Expected numbers come from the DeepSpeed
layout's arithmetic (12 bytes of fp32 master and Adam moments a parameter, divided by the
ranks), not from memlab's output.
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import math
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import readers_table  # noqa: E402 the table of issue 38, in tools/

from memlab.app.cli import main
from memlab.core.errors import InputError
from memlab.hf import read_run_configs as rc
from memlab.hf.shape import decoder_shape
from memlab.step.fine_tune_config import ALL_LINEAR
from memlab.step.states import param_numels

DATA = pathlib.Path(__file__).parent / "data" / "run_configs"
INDEX = {e["file"]: e for e in json.loads((DATA / "index.json").read_text())}
GIB = 2**30
ZEPHYR = ["--hf-config", "mistral-7b", "--training-args", str(DATA / "alignment-handbook/config_full.yaml")]


def cli(*argv: str) -> tuple[int, dict | str]:
    """``memlab estimate ARGV --json``: (exit code, the report or the error's last line)."""
    return readers_table.estimate(list(argv))


def f(name: str) -> str:
    assert name in INDEX, f"{name} has no provenance in index.json"
    return str(DATA / name)


def test_every_file_has_its_provenance():
    files = {str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_file() and p.name != "index.json"}
    assert files == set(INDEX)
    assert len(files) >= 30
    for e in INDEX.values():
        assert e["repo"] and e["path"] and e["commit"] and e["claim"]


# -- DeepSpeed JSONs: what DeepSpeed keeps where ---------------------------------------------
DS_READS = {  # file: (stage, offload, precision under bf16: true) from the file's own keys
    "llama-factory/ds_z0_config.json": (0, "none", "bf16"),
    "llama-factory/ds_z2_config.json": (2, "none", "bf16"),
    "llama-factory/ds_z2_offload_config.json": (2, "optimizer", "bf16"),
    "llama-factory/ds_z3_config.json": (3, "none", "bf16"),
    "llama-factory/ds_z3_offload_config.json": (3, "all", "bf16"),
    "llama-factory/ds_z2_autotp_config.json": (2, "none", "bf16"),
    "axolotl/zero1.json": (1, "none", "bf16"),
    "axolotl/zero2.json": (2, "optimizer", "bf16"),
    "axolotl/zero3_bf16.json": (3, "none", "bf16"),
    "axolotl/zero3_bf16_cpuoffload_params.json": (3, "params", "bf16"),
    "axolotl/zero3_bf16_cpuoffload_all.json": (3, "all", "bf16"),
}


@pytest.mark.parametrize("name", sorted(DS_READS))
def test_deepspeed_json_read_as_its_keys_say(name):
    ds = rc.read_deepspeed(f(name), world_size=8, hidden_size=4096, batch=16, precision="bf16")
    assert (ds.zero, ds.offload, ds.precision) == DS_READS[name]


ZERO3 = ["llama-factory/ds_z3_config.json", "llama-factory/ds_z3_offload_config.json", "axolotl/zero3_bf16.json",
         "axolotl/zero3_bf16_cpuoffload_params.json", "axolotl/zero3_bf16_cpuoffload_all.json"]


@pytest.mark.parametrize("name", ZERO3)
def test_zero3_configs_fit_the_handbooks_eight_80gb_cards(name):
    """The handbook's zephyr full fine-tune fits 8 x 80 GB under ZeRO-3; every ZeRO-3 config
    (offloads hold less on the device) must fit there too."""
    code, rep = cli(*ZEPHYR, "--deepspeed", f(name), "--world-size", "8", "--gpu", "A100-80GB")
    assert code == 0 and rep["fits"], rep


def test_zero0_holds_sixteen_bytes_a_parameter_more_than_a_card():
    """ZeRO-0 in bf16 keeps 2 + 2 + 12 bytes a parameter on every rank: 7.24e9 x 16 > 80 GiB."""
    code, rep = cli(*ZEPHYR, "--deepspeed", f("llama-factory/ds_z0_config.json"), "--world-size", "8",
                    "--gpu", "A100-80GB")
    cats = rep["by_category"]
    n = decoder_shape("mistral-7b").num_params()
    assert code == 0 and not rep["fits"]
    # 16 bytes a parameter in all (ZeRO-0 bf16: 4 + 4 + 8 under autocast, as 2 + 2 + 12 under
    # DeepSpeed's bf16); at a peak in forward (the loss's) the 4 of the gradients are not made yet
    held = cats["parameters"] + cats["optimizer"]
    if cats["gradients"] == 0:
        assert held == pytest.approx(12 * n, rel=0.01)
    else:
        assert held + cats["gradients"] == pytest.approx(16 * n, rel=0.01)


def test_parameter_only_offload_keeps_master_and_moments_on_the_device():
    """Issue 38's 70B case on the real axolotl file: offload_param cpu, no offload_optimizer.
    DeepSpeed 0.19.8 stage3.py:333 puts the fp32 partitions on the accelerator unless the
    optimizer is offloaded: 12 bytes x P / 8 of master and moments a rank (~98.6 GiB), the
    16-bit gradient partition 2 x P / 8; the 16-bit parameters 2 x P / 8 go to the host."""
    p = decoder_shape("llama-3.1-70b").num_params()
    run = ["--hf-config", "llama-3.1-70b", "--world-size", "8", "--gpu", "A100-80GB", "--seq", "2048",
           "--batch", "1", "--precision", "bf16", "--checkpointing", "full"]
    code, rep = cli(*run, "--deepspeed", f("axolotl/zero3_bf16_cpuoffload_params.json"))
    assert code == 0 and not rep["fits"]
    assert rep["by_category"]["optimizer"] == pytest.approx(12 * p / 8, rel=1e-3)
    assert rep["by_category"]["optimizer"] / GIB == pytest.approx(98.6, abs=0.5)
    assert rep["by_category"]["gradients"] == pytest.approx(2 * p / 8, rel=0.01)
    assert rep["host_by_category"]["parameters"] >= 2 * p / 8
    code, every = cli(*run, "--deepspeed", f("axolotl/zero3_bf16_cpuoffload_all.json"))
    assert code == 0 and every["by_category"]["optimizer"] == 0 and every["peak_bytes"] < rep["peak_bytes"] / 10


def test_autotp_is_named_not_dropped():
    ds = rc.read_deepspeed(f("llama-factory/ds_z2_autotp_config.json"), world_size=8, hidden_size=4096,
                           batch=1, precision="bf16")
    assert ds.tensor_parallel == 2
    assert any("tensor_parallel.autotp_size=2" in n for n in ds.notes)


def test_sub_group_size_zero_makes_every_parameter_a_sub_group():
    """axolotl's ZeRO-3 files set sub_group_size 0: DeepSpeed (stage3.py:1210-1232) then closes
    a sub-group after every parameter; the host keeps one pinned fp32 gradient buffer per
    parameter partition (it no longer tries to allocate a list of one-element groups)."""
    ds = rc.read_deepspeed(f("axolotl/zero3_bf16_cpuoffload_all.json"), world_size=8, hidden_size=4096,
                           batch=1, precision="bf16")
    assert ds.buckets.sub_group == 1
    code, rep = cli(*ZEPHYR, "--deepspeed", f("axolotl/zero3_bf16_cpuoffload_all.json"), "--world-size", "8")
    numels = param_numels(decoder_shape("mistral-7b"))
    part = sum(numels) / 8

    def pinned(nbytes: float) -> int:  # the CUDA host allocator's power-of-two blocks
        return 2 ** math.ceil(math.log2(nbytes))
    # one pinned fp32 gradient buffer per parameter's partition, and the 16-bit gradient partition
    expected = sum(pinned(4 * n / 8) for n in numels) + pinned(2 * part)
    assert code == 0 and rep["host_by_category"]["gradients"] == pytest.approx(expected, rel=1e-6)


def test_precision_as_accelerate_resolves_it():
    """fp16 "auto" and no bf16 section (a real config), launched by the Trainer with bf16: true:
    HF fills fp16.enabled False, accelerate's DeepSpeedPlugin.set_mixed_precision adds
    ``bf16: {enabled: true}``: DeepSpeed runs bf16, not fp32."""
    text = (DATA / "llm-self-control/deepspeed.py").read_text()
    config = ast.literal_eval(text.split("=", 1)[1])
    tr = rc.read_training_args(f("alignment-handbook/config_full.yaml"))
    # the file as it is: DeepSpeed 0.19.8 removed sparse attention and refuses the section
    with pytest.raises(InputError, match="sparse_attention"):
        rc.read_deepspeed(config, world_size=8, hidden_size=4096, trainer_args=tr.args)
    config.pop("sparse_attention")  # what a learner on today's DeepSpeed runs
    ds = rc.read_deepspeed(config, world_size=8, hidden_size=4096, trainer_args=tr.args)
    assert ds.precision == "bf16"
    assert any("set_mixed_precision" in n for n in ds.notes)
    fp32 = rc.read_deepspeed(config, world_size=8, hidden_size=4096, precision="fp32", batch=1)
    assert fp32.precision == "fp32"


def test_trainer_mismatch_quotes_the_yamls_own_learning_rate():
    code, line = cli(*ZEPHYR, "--deepspeed", f("transformers/ds_config_zero3.json"), "--world-size", "8")
    assert code == 2 and "hf learning_rate=2e-05" in line  # config_full.yaml's learning_rate: 2.0e-05
    assert "ds optimizer.params.lr=3e-05" in line


# -- accelerate configs ------------------------------------------------------------------------
ACC_READS = {  # file: (world size, mixed precision, ZeRO stage of its DeepSpeed plugin or FSDP)
    "alignment-handbook/zero3.yaml": (8, "bf16", 3),
    "alignment-handbook/fsdp.yaml": (8, "bf16", 3),
    "alignment-handbook/ddp.yaml": (8, "bf16", 0),
    "trl/deepspeed_zero1.yaml": (8, "bf16", 1),
    "trl/deepspeed_zero2.yaml": (8, "bf16", 2),
    "trl/deepspeed_zero3.yaml": (8, "bf16", 3),
    "trl/single_gpu.yaml": (1, "bf16", 0),
    "trl/multi_gpu.yaml": (8, "bf16", 0),
    "llama-factory/fsdp_config.yaml": (2, "bf16", 3),
}


@pytest.mark.parametrize("name", sorted(ACC_READS))
def test_accelerate_config_read_as_its_keys_say(name):
    acc = rc.read_accelerate(f(name))
    stage = acc.deepspeed["zero_optimization"]["stage"] if isinstance(acc.deepspeed, dict) else acc.zero
    assert (acc.world_size, acc.mixed_precision, stage) == ACC_READS[name]


@pytest.mark.parametrize("name", ["alignment-handbook/zero3.yaml", "alignment-handbook/fsdp.yaml",
                                  "trl/deepspeed_zero3.yaml"])
def test_handbook_full_run_fits_under_its_accelerate_config(name):
    code, rep = cli(*ZEPHYR, "--accelerate-config", f(name), "--gpu", "A100-80GB")
    assert code == 0 and rep["fits"] and rep["config"]["world_size"] == 8 and rep["config"]["zero"] == 3
    assert any("accelerate's rules" in n for n in rep["notes"])


def test_accelerate_config_given_as_deepspeed_is_named():
    code, line = cli(*ZEPHYR, "--deepspeed", f("trl/deepspeed_zero3.yaml"), "--world-size", "8")
    assert code == 2 and "accelerate config" in line and "--accelerate-config" in line


# -- training YAMLs of four launchers ------------------------------------------------------------
def test_handbook_qlora_recipe_is_the_qlora_run():
    """The issue's 127 GiB: config_qlora.yaml's model arguments now decide the run."""
    tr = rc.read_training_args(f("alignment-handbook/config_qlora.yaml"))
    assert tr.launcher == "trainer"
    assert tr.lora.rank == 16 and set(tr.lora.targets) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                                             "gate_proj", "up_proj", "down_proj"}
    assert tr.quantization.bits == 4 and tr.quantization.compute_dtype == "bf16"
    assert (tr.micro_batch, tr.accumulation, tr.seq, tr.checkpointing) == (4, 2, 2048, "full")
    code, rep = cli("--hf-config", "mistral-7b", "--training-args", f("alignment-handbook/config_qlora.yaml"),
                    "--gpu", "A100-80GB")
    p = decoder_shape("mistral-7b").num_params()
    assert code == 0 and rep["fits"]
    assert rep["by_category"]["parameters"] < 0.75 * p  # 4-bit linears: well under a byte a parameter
    assert rep["config"]["quantization"]["bits"] == 4 and rep["config"]["lora"]["rank"] == 16


LF = {  # file: (lora rank or None, targets, quantisation bits, seq, micro-batch x accumulation)
    "llama-factory/qwen3_lora_sft.yaml": (8, ALL_LINEAR, None, 2048, (1, 8)),
    "llama-factory/qwen3_lora_sft_otfq.yaml": (8, ALL_LINEAR, 4, 2048, (1, 8)),
    "llama-factory/qwen3_lora_sft_ds3.yaml": (8, ALL_LINEAR, None, 2048, (1, 2)),
    "llama-factory/qwen3_full_sft.yaml": (None, None, None, 2048, (1, 2)),
}


@pytest.mark.parametrize("name", sorted(LF))
def test_llamafactory_recipe_read_by_its_rules(name):
    tr = rc.read_training_args(f(name))
    rank, targets, bits, seq, (micro, acc) = LF[name]
    assert tr.launcher == "llamafactory" and any("LLaMA-Factory's rules" in n for n in tr.notes)
    assert (tr.lora.rank if tr.lora else None, tr.lora.targets if tr.lora else None) == (rank, targets)
    assert (tr.quantization.bits if tr.quantization else None, tr.seq) == (bits, seq)
    assert (tr.micro_batch, tr.accumulation, tr.checkpointing) == (micro, acc, "full")  # LF checkpoints by default


def test_llamafactory_lora_base_is_bf16_and_qlora_smaller():
    """LLaMA-Factory keeps a LoRA base in its bf16 dtype: 2 bytes a parameter (Qwen3-4B: 4.02e9
    x 2 = 7.5 GiB) and the 4-bit base is under a third of it."""
    model = f("models/qwen3-4b-instruct-2507.json")
    p = decoder_shape(model).num_params()
    code, lora = cli("--hf-config", model, "--training-args", f("llama-factory/qwen3_lora_sft.yaml"))
    code4, qlora = cli("--hf-config", model, "--training-args", f("llama-factory/qwen3_lora_sft_otfq.yaml"))
    assert code == code4 == 0
    assert lora["by_category"]["parameters"] == pytest.approx(2 * p, rel=0.02)
    assert qlora["by_category"]["parameters"] < lora["by_category"]["parameters"] / 2.5


def test_llamafactory_lora_under_zero3_is_a_one_line_refusal():
    code, line = cli("--hf-config", f("models/qwen3-4b-instruct-2507.json"), "--training-args",
                     f("llama-factory/qwen3_lora_sft_ds3.yaml"), "--world-size", "2")
    assert code == 2 and "LoRA under ZeRO-3" in line


AXOLOTL = {  # file: (lora rank, bits, seq, micro-batch, accumulation, optimizer)
    "axolotl/qlora.yml": (32, 4, 4096, 2, 4, "paged-adamw"),
    "axolotl/lora-8b.yml": (32, 8, 4096, 2, 4, "adamw-8bit"),
    "axolotl/fft-8b.yaml": (None, None, 8192, 1, 8, "paged-adamw-8bit"),
    "axolotl/qlora-fsdp-70b.yaml": (8, 4, 512, 1, 4, "adamw"),
}


@pytest.mark.parametrize("name", sorted(AXOLOTL))
def test_axolotl_yaml_read_by_its_rules(name):
    tr = rc.read_training_args(f(name))
    assert tr.launcher == "axolotl"
    got = (tr.lora.rank if tr.lora else None, tr.quantization.bits if tr.quantization else None, tr.seq,
           tr.micro_batch, tr.accumulation, tr.optimizer)
    assert got == AXOLOTL[name]


def test_axolotl_fft_8b_against_its_48gb_statement():
    """README: 'Full Fine Tune - Single GPU @ 48GB VRAM'. Weights and gradients in bf16 and
    paged 8-bit AdamW: 2 + 2 + ~2 bytes a parameter = 45 GiB of states alone, plus 8192
    tokens' activations and the loss: the README's own setting (the file's keys are those of
    the README's commit 15f7910d3 but for the base's 3.1 name and the attention key), so the
    estimate must fit the 48 GB card, and fill most of it."""
    p = decoder_shape("llama-3.1-8b").num_params()
    code, rep = cli("--hf-config", "llama-3.1-8b", "--training-args", f("axolotl/fft-8b.yaml"),
                    "--gpu", "L40S-48GB")
    assert code == 0 and rep["config"]["precision"] == "pure-bf16"
    assert rep["peak_bytes"] > 4 * p  # bf16 weights and gradients
    assert rep["fits"] and rep["peak_bytes"] <= rep["budget_bytes"]  # on the stated 48 GB card
    assert rep["peak_bytes"] > 0.85 * rep["budget_bytes"]  # and not far below: 8192 tokens' activations


def _llama2_7b(tmp_path) -> str:
    """Llama-2-7b-hf's config: transformers' LlamaConfig defaults (configuration_llama.py:
    ``@auto_docstring(checkpoint="meta-llama/Llama-2-7b-hf")``: width 4096, FFN 11008, 32 layers
    and heads, vocabulary 32,000) with Llama 2's 4096-token context (Touvron et al. 2023, sec. 2.2)."""
    from transformers import LlamaConfig
    path = tmp_path / "llama-2-7b.json"
    path.write_text(json.dumps(LlamaConfig(max_position_embeddings=4096).to_dict()))
    return str(path)


def test_axolotl_lora_8b_readme_claim_is_of_the_file_it_was_written_with(tmp_path):
    """README 'LoRA - Single GPU @ 11GB VRAM' was written with the file at 15f7910d3: a Llama-2-7B
    base (vocabulary 32,000), int8, r=32 on every Linear, 2 x 4096 packed tokens, checkpointing.
    memlab reads that file within 20% of 11 GiB (nvidia-smi's MiB, the figure learners quote).
    Today's file (Llama 3 8B: 128,256 logits a token, and embed_tokens and lm_head trained whole,
    not counted) reads far above it: the README was not updated, memlab's reading is not wrong."""
    code, then = cli("--hf-config", _llama2_7b(tmp_path), "--training-args", f("axolotl/lora-8b-15f7910.yml"))
    assert code == 0 and then["config"]["quantization"]["bits"] == 8
    assert 0.8 <= then["peak_bytes"] / (11 * GIB) <= 1.2, then["peak_bytes"] / GIB
    code, now = cli("--hf-config", "llama-3-8b", "--training-args", f("axolotl/lora-8b.yml"))
    assert code == 0 and now["peak_bytes"] > 1.5 * 11 * GIB
    assert any("lora_modules_to_save" in n for n in now["notes"])


def test_axolotl_lora_8b_names_its_modules_to_save():
    tr = rc.read_training_args(f("axolotl/lora-8b.yml"))
    assert any("lora_modules_to_save" in n and "lm_head" in n for n in tr.notes)


def test_axolotl_qlora_fsdp_70b_is_a_one_line_refusal():
    """FSDP full_shard over two cards is ZeRO-3's layout; LoRA under it is refused, naming it."""
    code, line = cli("--hf-config", "llama-3.1-70b", "--training-args", f("axolotl/qlora-fsdp-70b.yaml"),
                     "--world-size", "2")
    assert code == 2 and "LoRA under ZeRO-3" in line


# -- peft adapter configs ----------------------------------------------------------------------
def test_adapter_configs_read_as_their_keys_say():
    names = decoder_shape("qwen2.5-7b").linear_names()
    qwen = rc.read_lora_config(f("peft/qwen2.5-7b-mcq_adapter_config.json"), names)
    assert qwen.rank == 16 and set(qwen.targets) == set(names) and qwen.dropout == 0.05
    llama = rc.read_lora_config(f("peft/llama-3.2-3b-romanian_adapter_config.json"), names)
    assert llama.rank == 8 and llama.targets == ("q_proj", "v_proj")
    gemma = rc.read_lora_config(f("peft/gemma-2-9b-healthcare_adapter_config.json"), names)
    assert any("layers_to_transform" in n for n in gemma.notes)  # 26 of 42 layers: named, not dropped


def test_lora_on_lm_head_counts_its_two_matrices():
    """peft adapts the head when target_modules names it: A (r x hidden) and B (vocab x r)."""
    d = json.loads((DATA / "peft/qwen2.5-7b-mcq_adapter_config.json").read_text())
    shape = decoder_shape("qwen2.5-7b")
    base = ["--hf-config", "qwen2.5-7b", "--seq", "256", "--batch", "1", "--precision", "bf16"]
    code, plain = cli(*base, "--lora-rank", "16", "--lora-targets", ",".join(d["target_modules"]))
    code2, head = cli(*base, "--lora-rank", "16", "--lora-targets", ",".join(d["target_modules"] + ["lm_head"]))
    assert code == code2 == 0
    extra = 16 * (shape.d + shape.vocab)
    assert head["config"]["trainable_params"] - plain["config"]["trainable_params"] == extra
    # two fp32 AdamW moments (the peak is in the loss's backward, before the head's gradients)
    assert head["by_category"]["optimizer"] - plain["by_category"]["optimizer"] == 8 * extra
    spec = rc.read_lora_config({**d, "target_modules": d["target_modules"] + ["lm_head"]}, shape.linear_names())
    assert "lm_head" in spec.targets


def test_a_wrong_field_is_bad_input_naming_it():
    with pytest.raises(InputError, match="finetuning_type='oft'"):
        rc.read_training_args({"finetuning_type": "oft"})
    with pytest.raises(InputError, match="adapter='ia3'"):
        rc.read_training_args({"base_model": "x", "adapter": "ia3"})
    with pytest.raises(InputError, match="num_processes"):
        rc.read_accelerate({"distributed_type": "MULTI_GPU", "num_processes": 0})


# -- every DeepSpeed key that moves memory: modelled, or named -----------------------------------
def _z3(**zero) -> dict:
    """LLaMA-Factory's real ds_z3_config.json with ``zero`` changed in its zero_optimization."""
    d = json.loads((DATA / "llama-factory/ds_z3_config.json").read_text())
    d["zero_optimization"].update(zero)
    return d


def _est(config: dict, tmp_path: pathlib.Path) -> dict:
    path = tmp_path / f"ds{len(list(tmp_path.iterdir()))}.json"  # read by path, as the CLI reads a file
    path.write_text(json.dumps(config))
    code, rep = cli(*ZEPHYR, "--deepspeed", str(path), "--world-size", "8")
    assert code == 0, rep
    return rep


def _p7() -> int:
    return decoder_shape("mistral-7b").num_params()


def test_optimizer_only_offload_moves_master_and_moments_to_the_host(tmp_path):
    rep = _est(_z3(offload_optimizer={"device": "cpu", "pin_memory": True}), tmp_path)
    assert rep["by_category"]["optimizer"] == 0
    assert rep["host_by_category"]["optimizer"] >= 12 * _p7() / 8  # fp32 master + two moments


def test_parameter_only_offload_moves_only_the_16bit_partition(tmp_path):
    base, par = _est(_z3(), tmp_path), _est(_z3(offload_param={"device": "cpu", "pin_memory": True}), tmp_path)
    opt, params = (lambda r: r["by_category"]["optimizer"]), (lambda r: r["by_category"]["parameters"])
    assert opt(par) == opt(base) == pytest.approx(12 * _p7() / 8, rel=1e-3)
    assert params(base) - params(par) == pytest.approx(2 * _p7() / 8, rel=0.02)


def test_nvme_offload_is_cpu_offload_on_the_device_and_named(tmp_path):
    cpu = _est(_z3(offload_optimizer={"device": "cpu"}), tmp_path)
    nvme = _est(_z3(offload_optimizer={"device": "nvme", "nvme_path": "/local_nvme"}), tmp_path)
    assert nvme["peak_bytes"] == cpu["peak_bytes"]
    assert any("nvme" in n and "/local_nvme" in n for n in nvme["notes"])


@pytest.mark.parametrize("key,value,field", [
    ("stage3_max_live_parameters", 1e6, "gathered"), ("stage3_param_persistence_threshold", 1e7, "persistent")])
def test_bucket_keys_move_the_number(key, value, field, tmp_path):
    """Each size decides a buffer memlab counts (ZeroBuckets): changing it changes the peak."""
    assert _est(_z3(**{key: value}), tmp_path)["peak_bytes"] != _est(_z3(), tmp_path)["peak_bytes"], field


def test_sub_group_size_moves_the_pinned_host_gradients(tmp_path):
    """Under optimizer offload each sub-group's fp32 gradients are one pinned buffer (stage3.py
    _create_fp16_sub_groups closes a group at sub_group_size elements), and the CUDA host
    allocator rounds each up to a power of two: one 0.9e9-element partition takes 2**32 bytes,
    2e8-element groups take 2**30 each plus the rest's rounding."""
    off = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    big, small = _est(_z3(**off), tmp_path), _est(_z3(**off, sub_group_size=2e8), tmp_path)
    part = _p7() / 8
    rest = 4 * (part - 2e8 * (part // 2e8))
    expected = (part // 2e8) * 2**30 + 2 ** int(math.ceil(math.log2(rest))) - 2**32
    moved = small["host_by_category"]["gradients"] - big["host_by_category"]["gradients"]
    assert moved == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("key,value", [
    ("stage3_max_reuse_distance", 1e6), ("zero_hpz_partition_size", 8), ("zero_quantized_weights", True),
    ("zero_quantized_gradients", True), ("zero_quantized_nontrainable_weights", True),
    ("allgather_bucket_size", 1e8), ("contiguous_gradients", False)])
def test_unmodelled_keys_are_named(key, value, tmp_path):
    rep = _est(_z3(**{key: value}), tmp_path)
    assert any(key in n for n in rep["notes"]), rep["notes"]
    assert not any(key in n for n in _est(_z3(), tmp_path)["notes"] if "not modelled" in n or "moves memory" in n)


# -- the GRPO recipe that runs on a 16 GB T4 -------------------------------------------------------
def test_grpo_qlora_recipe_on_a_t4_fits_as_it_ran(tmp_path):
    """TRL's GRPO QLoRA notebook (index.json): a 7B Qwen2 in NF4 (bnb double quantisation), LoRA
    r=32 on every projection, 8 completions of 256 tokens, paged 8-bit AdamW, checkpointing, on
    a free T4. The GRPO estimate dropped --load-in-4bit (an fp32 base: 30.8 GiB, the issue's
    "29 GiB"); the file as written now fits the T4.

    Its printed run was made at c9a9e25, whose code loaded the model in float16 (4d52e02 later
    wrote dtype="float32" and kept the outputs): that run held at most 6.773 GiB reserved before
    training and 8.832 GiB at its peak. The same run with the base's unquantised modules in
    fp16 must hold no more than each (the reserve holds the allocated bytes) and not far less
    (within 20% of the peak); the file as written holds 2 bytes more for each of those
    modules' parameters (fp32 against fp16)."""
    from memlab.hf import post_training
    from memlab.step.fine_tune_config import LoraConfig, QuantConfig
    nb = json.loads((DATA / "trl/grpo_trl_lora_qlora.ipynb").read_text())
    grpo, lora = readers_table.notebook_call(nb, "GRPOConfig"), readers_table.notebook_call(nb, "LoraConfig")
    bnb = readers_table.notebook_call(nb, "BitsAndBytesConfig")
    assert bnb["load_in_4bit"] and bnb["bnb_4bit_quant_type"] == "nf4" and bnb["bnb_4bit_use_double_quant"]
    # max_memory_reserved() / 1024**3, printed as "GB"
    peak = readers_table.notebook_number(nb, r"Peak reserved memory = ([\d.]+) GB") * GIB
    before = readers_table.notebook_number(nb, r"([\d.]+) GB of memory reserved") * GIB
    total = readers_table.notebook_number(nb, r"Max memory = ([\d.]+) GB") * GIB
    path = tmp_path / "grpo.json"
    path.write_text(json.dumps(grpo))
    # Qwen2.5-7B's config is Qwen2-7B's shape (3584 wide, 28 layers, 152,064 tokens); the notebook
    # lists both at ~9.2GB. The prompt: its system prompt and a NuminaMath problem, under 256 tokens
    run = ["--hf-config", "qwen2.5-7b", "--training-args", str(path), "--seq", "256",
           "--lora-rank", str(lora["r"]), "--lora-targets", ",".join(lora["target_modules"]), "--gpu", "T4-16GB"]
    code, rep = cli(*run, "--load-in-4bit")
    assert code == 0, rep
    assert rep["fits"] and rep["peak_bytes"] < total
    assert any(n.startswith("load_in_4bit") for n in rep["notes"])
    assert any("use_liger_kernel" in n for n in rep["notes"])  # named, not modelled
    code, fp32 = cli(*run)  # the same run without the 4-bit base is a full fp32 base: it does not fit
    assert code == 2 or not fp32["fits"]
    # the recorded run: float16 load, fp16 compute
    trl = post_training.read_trl_args(grpo, prompt_len=256)
    adapters = LoraConfig(rank=lora["r"], targets=tuple(lora["target_modules"]))
    fp16 = post_training.estimate_trl_run("qwen2.5-7b", trl, lora=adapters, card="T4-16GB", quantization=QuantConfig(
        bits=4, compute_dtype="fp16", base_dtype="fp16"))
    assert fp16.by_category["parameters"] <= before and 0.8 * peak <= fp16.peak_bytes <= peak, fp16.peak_bytes / GIB
    s = decoder_shape("qwen2.5-7b")
    linear = sum(i * o for k in range(s.n_layer) for v in s.linears(k).values() for i, o in v)
    assert rep["by_category"]["parameters"] - fp16.by_category["parameters"] == 2 * (s.num_params() - linear)
    # TRL casts what trains on a quantised base to bf16 (trl 1.16 grpo_trainer.py lines 538-541):
    # r x (in + out) a projection, two bytes each
    from memlab.step.decoder_states import quantized_base_bytes
    adapter = sum(lora["r"] * (i + o) for k in range(s.n_layer) for v in s.linears(k).values() for i, o in v)
    base, _ = quantized_base_bytes(s, QuantConfig(bits=4, compute_dtype="fp16", base_dtype="fp16"))
    assert fp16.by_category["parameters"] - base == 2 * adapter


def test_grpo_simulate_refuses_a_quantised_base(tmp_path):
    grpo = readers_table.notebook_call(json.loads((DATA / "trl/grpo_trl_lora_qlora.ipynb").read_text()), "GRPOConfig")
    path = tmp_path / "grpo.json"
    path.write_text(json.dumps(grpo))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["simulate", "--hf-config", "qwen2.5-7b", "--training-args", str(path), "--seq", "256",
                         "--lora-rank", "32", "--load-in-4bit"])
        except SystemExit as e:
            code = e.code
    assert code == 2 and "--load-in-4bit" in err.getvalue().strip().splitlines()[-1]


# -- no key silently dropped ----------------------------------------------------------------------
def _yaml(name: str) -> dict:
    return rc.load_file(f(name), "--training-args")


@pytest.mark.parametrize("name,added", [
    ("axolotl/lora-8b.yml", {"liger_fused_linear_cross_entropy": True, "tokens": ["<tool>"]}),
    ("axolotl/fft-8b.yaml", {"plugins": ["axolotl.integrations.liger.LigerPlugin"],
                             "unfrozen_parameters": ["^lm_head"]}),
    ("llama-factory/qwen3_lora_sft.yaml", {"use_unsloth": True, "rope_scaling": "linear"}),
])
def test_a_key_the_reader_does_not_model_is_named(name, added):
    """Keys that change memory in each launcher's schema, added to a real recipe: each is named in a note."""
    def named(d: dict) -> set[str]:
        return {k.strip() for n in rc.read_training_args(d).notes if "not modelled: " in n
                for k in n.split("not modelled: ", 1)[1].split(",")}
    assert not named(_yaml(name)) & set(added)
    assert named({**_yaml(name), **added}) >= set(added)


def test_axolotl_attention_switches_are_read():
    """axolotl spelled the attention as flash_attention: true before e4032fc9 (the 15f7910 file)
    and attn_implementation after; eager_attention is HF's own attention, which memlab counts
    with its scores (--attention naive)."""
    assert rc.read_training_args(f("axolotl/lora-8b-15f7910.yml")).attention == "flash_attention_2"
    assert rc.read_training_args(f("axolotl/lora-8b.yml")).attention == "flash_attention_2"
    d = {k: v for k, v in _yaml("axolotl/fft-8b.yaml").items() if k != "attn_implementation"}
    eager = rc.read_training_args({**d, "eager_attention": True})
    assert eager.attention == "eager"
    code, flash = cli("--hf-config", "llama-3.1-8b", "--training-args", f("axolotl/fft-8b.yaml"), "--gpu", "L40S-48GB")
    assert code == 0 and "attention: flash" in flash["notes"][0]


# -- the table: every real file against its source's own statement ---------------------------------
def test_every_real_file_has_a_row_in_the_table():
    assert set(readers_table.RUNS) == set(INDEX)


@pytest.mark.parametrize("expect,code,rep,ok", [
    ("fits", 0, {"peak_bytes": GIB, "budget_bytes": 2 * GIB, "fits": True}, True),
    ("fits", 0, {"peak_bytes": 3 * GIB, "budget_bytes": 2 * GIB, "fits": False}, False),
    ("near:10:0.15", 0, {"peak_bytes": 11 * GIB}, True),
    ("near:10:0.15", 0, {"peak_bytes": 12 * GIB}, False),
    ("above:12.37", 0, {"peak_bytes": 12 * GIB}, False),
    ("refuse:LoRA under ZeRO-3", 2, "memlab: error: LoRA under ZeRO-3 (...) is not counted", True),
    ("refuse:LoRA under ZeRO-3", 2, "memlab: error: something else", False),
    ("fits", 2, "memlab: error: LoRA under ZeRO-3", False),
])
def test_the_table_judges_an_answer_by_its_sources_statement(expect, code, rep, ok):
    assert readers_table.judge(expect, code, rep)[1] is ok


def test_lora_8b_floor_is_the_files_arithmetic():
    """Llama 3 8B: 32 layers x (4096 x 10240 attention + 3 x 4096 x 14336 MLP) linear weights at
    a byte, the embedding and head (2 x 128,256 x 4096) and 65 norms of 4096 at two, and
    2 x 4096 x 128,256 fp32 logits: 12.37 GiB before activations, adapters or optimizer, above
    the README's 11 GB (written for the Llama-2-7B file of 15f7910)."""
    linear = 32 * (4096 * 10240 + 3 * 4096 * 14336)
    rest = 2 * 128_256 * 4096 + 65 * 4096
    assert readers_table.lora_8b_floor() == pytest.approx((linear + 2 * rest + 4 * 2 * 4096 * 128_256) / GIB,
                                                          rel=1e-12)
    assert readers_table.lora_8b_floor() > 11e9 / GIB


def test_every_real_file_agrees_with_its_source():
    """The whole table (tools/readers_table.py --configs): 38 estimates, under 3 s once the
    readers are loaded."""
    rows = readers_table.run_config_rows()
    assert len(rows) >= 30
    assert [r.file for r in rows if not r.consistent] == []


def test_qlora_under_autocast_saves_no_16bit_copy_of_the_base():
    """Issue 38's case: Llama 3 8B at 224 tokens, bf16 autocast, no checkpointing. Over an fp32
    base each frozen Linear whose input needs a gradient saves its weight's bf16 cast (all but
    the first layer's q, k, v, gate and up: 2 x (6.98e9 - 0.14e9) bytes, 12.7 GiB); over an NF4
    base bitsandbytes' MatMul4Bit saves only the packed weight (ctx.tensors = (None, B)), so the
    QLoRA run keeps at least that much less, and its activations are under 2 GiB."""
    base = ["--hf-config", "llama-3-8b", "--seq", "224", "--batch", "1", "--precision", "bf16",
            "--checkpointing", "none", "--lora-rank", "16"]
    code, lora = cli(*base)
    code4, qlora = cli(*base, "--load-in-4bit")
    assert code == code4 == 0
    linear = 32 * (4096 * 10240 + 3 * 4096 * 14336)
    first = 4096 * (4096 + 1024 + 1024) + 2 * 4096 * 14336  # layer 0's inputs come from the frozen embedding
    copies = 2 * (linear - first)
    assert lora["by_category"]["activations"] - qlora["by_category"]["activations"] >= copies
    assert qlora["by_category"]["activations"] < 2 * GIB
