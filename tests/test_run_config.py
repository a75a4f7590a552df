"""A run as its configs write it: a DeepSpeed JSON through --deepspeed (its "auto" values as HF's
Trainer fills them, DeepSpeed's own reading and refusals, its bucket sizes in the estimate) and
peft's adapter_config.json."""
import json
from importlib import resources

import pytest
from hf_gpt_mapping import gpt_config

from memlab.app.cli import main
from memlab.core.errors import InputError
from memlab.hf import config as hf
from memlab.hf import read_run_configs as run_config
from memlab.step.training_step import StepConfig
from memlab.step.write_deepspeed_config import deepspeed_config

CURRICULUM = str(resources.files("memlab").joinpath("data", "deepspeed", "curriculum.json"))
HF = ["--hf-config", "gpt2", "--seq", "256", "--checkpointing", "full", "--gpu", "A100-80GB"]


def _json(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_shipped_config_is_the_curriculums():
    """course/curriculum.md sec. 5: train_batch_size 8, accumulation 4, fp16, ZeRO-3 with the
    optimizer offloaded to the CPU, activation checkpointing partitioned and contiguous."""
    cfg = json.loads(open(CURRICULUM).read())
    assert cfg["train_batch_size"] == 8 and cfg["gradient_accumulation_steps"] == 4
    assert cfg["fp16"]["enabled"] and cfg["zero_optimization"]["stage"] == 3
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["activation_checkpointing"] == {"partition_activations": True,
                                               "contiguous_memory_optimization": True}


def test_curriculum_config_as_lesson_10_runs_it_equals_the_flags(tmp_path, capsys):
    """Lesson 10 runs the curriculum's config with memlab's bucket sizes merged in; through
    --deepspeed on 2 ranks of GPT-2 it is the estimate of the equivalent flags: DeepSpeed derives
    the micro-batch 8 / (4 x 2) = 1, so 4 sequences per rank in 4 micro-batches."""
    cfg = json.loads(open(CURRICULUM).read())
    step = StepConfig(zero=3, world_size=2)
    cfg["zero_optimization"] = {**deepspeed_config(step)["zero_optimization"], **cfg["zero_optimization"]}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    via = _json(capsys, ["estimate", *HF, "--world-size", "2", "--deepspeed", str(path), "--json"])
    flags = _json(capsys, ["estimate", *HF, "--world-size", "2", "--zero", "3", "--offload", "optimizer",
                           "--precision", "fp16", "--batch", "4", "--micro-batches", "4", "--json"])
    assert via["config"]["batch"] == 4 and via["config"]["micro_batches"] == 4
    assert via["peak_bytes"] == pytest.approx(flags["peak_bytes"], rel=0.001)
    assert via["host_bytes"] == pytest.approx(flags["host_bytes"], rel=0.001)
    assert any("partition_activations" in n for n in via["notes"])


def test_curriculum_config_as_written_has_deepspeeds_default_buckets(capsys):
    """Without bucket keys DeepSpeed's defaults hold: its config class says reduce_bucket_size
    5e8 elements. The reduce bucket is held all step (16-bit: 2 bytes an element), so against
    the flags (memlab's 2**20) the held gradients grow by exactly that difference."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    default = int(DeepSpeedZeroConfig().reduce_bucket_size)
    capsys.readouterr()  # what DeepSpeed logs on stdout when this test imports it first
    via = _json(capsys, ["estimate", *HF, "--world-size", "2", "--deepspeed", CURRICULUM, "--json"])
    flags = _json(capsys, ["estimate", *HF, "--world-size", "2", "--zero", "3", "--offload", "optimizer",
                           "--precision", "fp16", "--batch", "4", "--micro-batches", "4", "--json"])
    grown = via["by_category"]["gradients"] - flags["by_category"]["gradients"]
    assert grown == 2 * (default - 2**20)


def test_auto_values_are_filled_as_the_trainer_fills_them():
    """HF's rules (transformers/integrations/deepspeed.py): the micro-batch from the per-device
    batch, train_batch_size = ranks x micro x accumulation, bf16 from the precision,
    reduce_bucket_size = hidden^2, stage3_prefetch_bucket_size = 0.9 hidden^2,
    stage3_param_persistence_threshold = 10 hidden."""
    auto = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "bf16": {"enabled": "auto"},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                  "stage3_prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto"}}
    h = 768
    run = run_config.read_deepspeed(auto, world_size=2, hidden_size=h, batch=8, micro_batches=2,
                                    precision="bf16")
    assert (run.micro_batch, run.accumulation, run.train_batch) == (4, 2, 2 * 4 * 2)
    assert run.precision == "bf16" and run.zero == 3 and run.batch == 8
    assert (run.buckets.reduce, run.buckets.prefetch, run.buckets.persistence) == (h * h, int(0.9 * h * h), 10 * h)


@pytest.mark.parametrize("config, needle", [
    ({"train_batch_size": 8, "gradient_accumulation_steps": 3}, "train_batch_size is not equal"),
    ({"train_batch_size": 8, "zero_optimization": {"stage": 5}}, "Input should be 0, 1, 2, 3"),
    ({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "bfloat16 and fp16 modes cannot be simultaneously enabled"),
])
def test_a_config_deepspeed_rejects_exits_2_with_its_reason(config, needle, tmp_path, capsys):
    """The reasons are DeepSpeed's own (runtime/config.py and its pydantic ZeRO config)."""
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(config))
    assert main(["estimate", "--model", "tiny", "--world-size", "2", "--deepspeed", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_bucket_sizes_change_the_estimate_by_deepspeeds_accounting():
    """The fast sibling of the measured check below: DeepSpeed's accounting of the comm bucket
    is reduce_bucket_size elements of the model's dtype (deepspeed_zero.zero_accounting); two
    buckets at stages 1-2 under overlap_comm (stage_1_and_2.py setup_buckets)."""
    from memlab.lenses.estimate import estimate_step
    step = StepConfig(model="tiny", seq=64, batch=4, zero=2, world_size=2)
    base = deepspeed_config(step)
    peaks = {}
    for n, overlap in ((2**20, False), (2**21, False), (2**21, True)):
        cfg = json.loads(json.dumps(base))
        cfg["zero_optimization"].update(reduce_bucket_size=n, overlap_comm=overlap)
        run = run_config.read_deepspeed(cfg, world_size=2, hidden_size=128)
        peaks[n, overlap] = estimate_step(step, buckets=run.buckets, target="cpu").peak_bytes
    assert peaks[2**21, False] - peaks[2**20, False] == 4 * (2**21 - 2**20)
    assert peaks[2**21, True] - peaks[2**21, False] == 4 * 2**21


def test_lora_config_is_read_as_peft_writes_it(tmp_path):
    cfg = gpt_config("llama-3-8b")
    path = tmp_path / "adapter_config.json"
    path.write_text(json.dumps({"peft_type": "LORA", "r": 16, "target_modules": ["q_proj", "v_proj"],
                                "lora_alpha": 32, "modules_to_save": ["lm_head"]}))
    spec = run_config.read_lora_config(path, cfg)
    assert spec.rank == 16 and set(spec.targets) == {"q_proj", "v_proj"}
    assert any("modules_to_save" in n for n in spec.notes)
    assert run_config.read_lora_config({"r": 4, "target_modules": "all-linear"}, cfg).targets == \
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with pytest.raises(InputError, match="names"):
        run_config.read_lora_config({"r": 4, "target_modules": ["c_attn"]}, cfg)


def _training_args(tmp_path, **kw) -> str:
    """A real TrainingArguments, written as the Trainer's to_json_string() writes it."""
    from transformers import TrainingArguments
    path = tmp_path / "args.json"
    path.write_text(TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, **kw).to_json_string())
    return str(path)


def _bnb_adam8bit_state_bytes(numels: list[int]) -> int:
    """bitsandbytes 0.50's 8-bit Adam state (optim/optimizer.py, Optimizer2State.init_state):
    a tensor under min_8bit_size (4096) keeps two fp32 moments; a larger one two uint8 moments
    and two fp32 absmax per block of 256; the two 256-entry fp32 quantisation maps are shared."""
    return sum(8 * n if n < 4096 else 2 * n + 2 * 4 * -(-n // 256) for n in numels) + 2 * 256 * 4


def test_training_args_are_the_step_they_describe(tmp_path, capsys):
    """per-device batch 2 x accumulation 4, bf16, gradient checkpointing (non-reentrant), 8-bit
    AdamW by its HF name, read as transformers reads them: the Trainer's own optimizer choice
    (Trainer.get_optimizer_cls_and_kwargs) and HF's batch semantics, and the peak's states
    counted from the real GPT-2 (fp32 weights and gradients under autocast, bitsandbytes' 8-bit
    state); a field memlab does not model (torch_compile, neftune) is named, not dropped."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    kw = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4, bf16=True,
              gradient_checkpointing=True, optim="adamw_bnb_8bit",
              gradient_checkpointing_kwargs={"use_reentrant": False}, torch_compile=True,
              neftune_noise_alpha=5.0)
    path = _training_args(tmp_path, **kw)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, **kw)
    opt_cls, opt_kw = Trainer.get_optimizer_cls_and_kwargs(args)
    assert opt_cls.__module__.startswith("bitsandbytes") and opt_kw["optim_bits"] == 8
    common = ["estimate", "--hf-config", "gpt2", "--seq", "256", "--target", "cpu", "--json"]
    via = _json(capsys, [*common, "--training-args", path])
    c = via["config"]
    per_device, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    assert (c["batch"], c["micro_batches"]) == (per_device * accumulation, accumulation)
    assert (c["precision"], c["checkpointing"], c["optimizer"]) == ("bf16", "full", "adamw-8bit")
    with torch.device("meta"):
        gpt2 = AutoModelForCausalLM.from_config(hf.hf_config(hf.load_config("gpt2")))
    numels = [p.numel() for p in gpt2.parameters()]
    n = sum(numels)
    assert n == 124_439_808 == c["num_params"]  # GPT-2 small, tied head
    cats = via["by_category"]
    assert (cats["parameters"], cats["gradients"]) == (4 * n, 4 * n)  # gradients held over the 4 micro-batches
    assert cats["optimizer"] == _bnb_adam8bit_state_bytes(numels)
    # one micro-batch of 2 in flight: less than the same step without accumulation
    flat = _json(capsys, [*common, "--batch", "8", "--precision", "bf16", "--checkpointing", "full",
                          "--optimizer", "adamw-8bit"])
    assert via["peak_bytes"] < flat["peak_bytes"]
    note = next(n for n in via["notes"] if "not modelled" in n)
    assert "torch_compile" in note and "neftune_noise_alpha" in note
    assert any("use_reentrant=False" in n for n in via["notes"])


def test_sft_config_yaml_max_length_and_packing(tmp_path, capsys):
    """TRL's SFTConfig fields: max_length sets the sequence, packing is explained."""
    path = tmp_path / "sft.yaml"
    path.write_text("per_device_train_batch_size: 1\nmax_length: 512\npacking: true\nbf16: true\n"
                    "dataset_text_field: text\n")
    out = _json(capsys, ["estimate", "--hf-config", "gpt2", "--target", "cpu", "--training-args",
                         str(path), "--json"])
    assert out["seq"] == 512 and out["batch"] == 1 and out["config"]["precision"] == "bf16"
    assert any("packing" in n for n in out["notes"])


def test_training_args_deepspeed_mismatch_is_hfs_error(tmp_path, capsys):
    """The Trainer refuses a DeepSpeed config whose batch keys contradict TrainingArguments."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}))
    path = _training_args(tmp_path, per_device_train_batch_size=2, deepspeed=str(ds))
    assert main(["estimate", "--model", "tiny", "--seq", "64", "--world-size", "2",
                 "--training-args", path]) == 2
    err = capsys.readouterr().err
    assert "mismatch TrainingArguments" in err and err.count("\n") == 1


@pytest.mark.slow
def test_bucket_sizes_change_a_real_deepspeed_run_as_the_estimate_says(tmp_path, capsys):
    """Two real DeepSpeed ZeRO-1 runs of the tiny GPT on 2 CPU ranks with the user's
    reduce_bucket_size at 2**20 and 2**22 elements: the measured peak moves by what the
    estimate moves and by what DeepSpeed's own accounting of its comm bucket moves, within 5%
    (achieved: all three 12,582,912 bytes). Fast sibling:
    test_bucket_sizes_change_the_estimate_by_deepspeeds_accounting."""
    base = deepspeed_config(StepConfig(model="tiny", seq=64, batch=4, zero=1, world_size=2))
    out = {}
    for n in (2**20, 2**22):
        cfg = json.loads(json.dumps(base))
        cfg["zero_optimization"]["reduce_bucket_size"] = n
        path = tmp_path / f"ds_{n}.json"
        path.write_text(json.dumps(cfg))
        argv = ["--model", "tiny", "--seq", "64", "--batch", "4", "--world-size", "2",
                "--deepspeed", str(path), "--json"]
        out[n] = (_json(capsys, ["estimate", *argv, "--target", "cpu"]), _json(capsys, ["measure", *argv]))
    est = out[2**22][0]["peak_bytes"] - out[2**20][0]["peak_bytes"]
    real = out[2**22][1]["peak_bytes"] - out[2**20][1]["peak_bytes"]
    accounted = out[2**22][1]["allocator"]["comm_buffers"] - out[2**20][1]["allocator"]["comm_buffers"]
    assert est == accounted == 4 * (2**22 - 2**20)
    assert real == pytest.approx(est, rel=0.05)


def _plain_cases() -> list[dict]:
    """Configs read from the JSON alone: the curriculum's, memlab's writer's at every stage and
    offload, the benchmark's, and ones that set ZeRO fields away from DeepSpeed's defaults."""
    cases = [json.loads(open(CURRICULUM).read()),
             {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2}},
             {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {
                 "stage": 3, "overlap_comm": None, "reduce_bucket_size": 5e8, "stage3_max_reuse_distance": 10,
                 "allgather_bucket_size": 7, "stage3_prefetch_bucket_size": 1000}},
             {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {
                 "stage": 1, "contiguous_gradients": False, "overlap_comm": True,
                 "offload_optimizer": {"device": "cpu", "pin_memory": False}}}]
    for zero, offload in ((0, "none"), (1, "none"), (2, "none"), (3, "none"), (2, "optimizer"), (3, "all")):
        for precision in ("fp32", "bf16"):
            cases.append(deepspeed_config(StepConfig(zero=zero, offload=offload, world_size=2, batch=4,
                                                     micro_batches=2, precision=precision)))
    return cases


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_plain_config_reads_as_deepspeed_reads_it(world_size):
    """The JSON reading (run_config.plain_reading) is DeepSpeed's own: each config, on 1 and 2
    ranks, gives the same DeepSpeedRun (stage, offload, precision, batch sizes DeepSpeed derives,
    bucket sizes with its defaults, the notes of fields away from its defaults) as
    DeepSpeedConfig, or the same refusal in the same words."""
    plain = 0
    for config in _plain_cases():
        runs = []
        for via in (False, True):
            try:
                runs.append(run_config.read_deepspeed(json.loads(json.dumps(config)), world_size=world_size,
                                                      hidden_size=64, via_deepspeed=via))
            except InputError as e:
                runs.append(str(e))
        assert runs[0] == runs[1], config
        try:
            plain += run_config.plain_reading(config, world_size) is not None
        except InputError:
            plain += 1
    assert plain == len(_plain_cases())  # each was read without DeepSpeed


@pytest.mark.parametrize("config", [
    {"train_batch_size": 8, "gradient_accumulation_steps": 3},
    {"gradient_accumulation_steps": 2},
    {"train_batch_size": 1, "gradient_accumulation_steps": 1},
    {"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
    {"train_batch_size": 8, "zero_optimization": {"stage": 5}},
    {"train_batch_size": 8, "zero_optimization": {"stage": 2, "reduce_bucket_size": 0}},
])
def test_a_refused_config_is_refused_in_deepspeeds_words_either_way(config):
    """DeepSpeed's batch rule (runtime/config.py _batch_assertion, written once in
    write_deepspeed_config.deepspeed_batch_sizes), its fp16-with-bf16 assertion and its pydantic
    refusals (read by DeepSpeed itself: plain_reading leaves them to it) say the same words."""
    words = []
    for via in (False, True):
        with pytest.raises(InputError) as e:
            run_config.read_deepspeed(config, world_size=2, hidden_size=64, via_deepspeed=via)
        words.append(str(e.value))
    assert words[0] == words[1] and words[0].startswith("DeepSpeed rejects this config: ")


def test_plain_zero_fields_are_deepspeeds_own():
    """Each ZeRO field the JSON reading knows has DeepSpeedZeroConfig's alias and default, in the
    class's order, and the offload sections' defaults are its offload configs' (a DeepSpeed
    upgrade that moves one fails here)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )
    fields, default = DeepSpeedZeroConfig.model_fields, DeepSpeedZeroConfig()
    assert list(run_config.PLAIN_ZERO) == [n for n in fields if n in run_config.PLAIN_ZERO]
    for name, (alias, value, _) in run_config.PLAIN_ZERO.items():
        assert fields[name].alias == alias, name
        want = getattr(default, name) if name != "overlap_comm" else fields[name].default
        assert value == want, name
    for name, cls in (("offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig),
                      ("offload_param", DeepSpeedZeroOffloadParamConfig)):
        sec = cls()
        for key, value in run_config.PLAIN_OFFLOAD[name].items():
            assert str(getattr(getattr(sec, key), "value", getattr(sec, key))) == str(value), (name, key)


def _runs() -> dict:
    """One run of each kind: memlab's GPT (a preset with a step switch), its UNet, a decoder's
    full run (LoRA, 4-bit base, ZeRO with a config's buckets, tensor parallelism) and a mixture of
    experts over expert-parallel ranks."""
    from memlab.hf.shape import decoder_shape
    from memlab.step.fine_tune_config import LoraConfig, QuantConfig
    from memlab.step.parallel_dims import ParallelDims
    from memlab.step.states import ZeroBuckets
    qwen = decoder_shape("qwen3-8b")
    return {"gpt": StepConfig("gpt2-small", seq=512, batch=2, checkpointing="selective", precision="bf16"),
            "unet": StepConfig("unet-small", seq=64, batch=4),
            "qlora": StepConfig(qwen, seq=2048, batch=2, precision="bf16", zero=2, world_size=4,
                                lora=LoraConfig(rank=16, dropout=0.05, targets="all-linear"),
                                quantization=QuantConfig(bits=4, double_quant=False, compute_dtype="bf16"),
                                buckets=ZeroBuckets(reduce=5 * 10**7), checkpointing="full"),
            "tp": StepConfig(qwen, seq=4096, batch=1, precision="bf16", zero=3, world_size=8,
                             parallel=ParallelDims(tensor=2)),
            "ep": StepConfig(decoder_shape("qwen3-30b-a3b"), seq=4096, batch=1, precision="bf16", world_size=8,
                             parallel=ParallelDims(expert=8, expert_imbalance=1.5))}


@pytest.mark.parametrize("name", ["gpt", "unet", "qlora", "tp", "ep"])
def test_a_run_survives_its_json(name):
    """Issue 36's JSON boundary: ``StepConfig.from_dict`` rebuilds the run ``describe`` wrote,
    through JSON text, to the field (a preset name comes back as its config, an unset
    checkpointing as the one the run uses)."""
    from dataclasses import replace
    run = _runs()[name]
    back = StepConfig.from_dict(json.loads(json.dumps(run.describe())))
    assert back.describe() == run.describe()
    assert back.checkpointing_used == run.checkpointing_used
    if not isinstance(run.model, str):
        assert replace(back, checkpointing=run.checkpointing) == run


def test_the_clis_json_is_the_run_it_estimated(tmp_path, capsys):
    """The flags, a Trainer YAML and a DeepSpeed JSON make one run; ``--json`` prints it, and that
    run, rebuilt, estimates the printed peak to the byte."""
    from memlab.lenses.estimate import estimate_step
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                              "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    out = _json(capsys, ["estimate", "--hf-config", "qwen3-8b", "--seq", "2048", "--load-in-4bit",
                         "--lora-rank", "16", "--deepspeed", str(ds), "--gpu", "A100-80GB", "--json"])
    run = StepConfig.from_dict(out["config"])
    assert (run.zero, run.micro_batches, run.lora.rank, run.quantization.bits) == (2, 2, 16, 4)
    assert estimate_step(run, card="A100-80GB").peak_bytes == out["peak_bytes"]


def test_a_run_with_a_field_it_does_not_have_is_bad_input():
    with pytest.raises(InputError, match=r"run fields \['tensor_parallel'\]; allowed: .*parallel"):
        StepConfig.from_dict({"model": "tiny", "seq": 16, "batch": 2, "tensor_parallel": 2})
