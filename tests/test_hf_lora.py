"""LoRA on today's decoder families: the estimate against peft's real step, on CPU.

The expected number is the real step (``transformers`` + ``peft`` adapters, fused AdamW over
the adapters) tracked by memlab's tracker (``track_step``, equal to torch's ``MemTracker`` in
tests/test_hf_families.py); the estimate is closed form (memlab.hf.estimate). The adapters are
the issue's "LoRA r=8 with dropout 0.1" and its dropout-free twin, on every ``Linear`` of the
dense families' layers (peft's ``all-linear``) and on the attention projections of the
mixtures of experts (whose routed experts peft's ``all-linear`` would wrap as parameters).
"""
import functools
import json

import pytest
import torch

pytest.importorskip("peft")

from hf_families import BATCH, FAMILIES, SEQ, family_marks  # noqa: E402

from memlab.app.cli import main  # noqa: E402
from memlab.core.errors import InputError  # noqa: E402
from memlab.hf import config as hf  # noqa: E402
from memlab.hf.estimate import estimate_hf  # noqa: E402
from memlab.hf.shape import decoder_shape  # noqa: E402
from memlab.lenses.your_model import track_step  # noqa: E402
from memlab.step.decoder_states import adapter_shapes, adapters_for  # noqa: E402
from memlab.step.fine_tune_config import LoraConfig  # noqa: E402

LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
CONFIGS = {"llama": LLAMA, **FAMILIES}
MOE = {"mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"}
ATTENTION = {"deepseek_v3": "q_a_proj,kv_a_proj_with_mqa,o_proj"}


def _lora(name: str, dropout: float) -> LoraConfig:
    targets = ATTENTION.get(name, "q_proj,k_proj,v_proj,o_proj") if name in MOE else "all-linear"
    return LoraConfig(rank=8, targets=targets, dropout=dropout)


@functools.lru_cache(maxsize=None)
def _measured(name: str, prec: str, dropout: float):
    torch.manual_seed(0)
    model, opt = hf.build_fn(CONFIGS[name], precision=prec, lora=_lora(name, dropout).peft_kwargs())()
    step = hf.causal_lm_step(SEQ, BATCH, prec)
    return model, track_step(lambda: step(model, opt), model=model, optimizer=opt)


CASES = [pytest.param(n, p, d, marks=family_marks(n)) for n in CONFIGS for p in ("fp32", "bf16") for d in (0.0, 0.1)]


@pytest.mark.parametrize("name,prec,dropout", CASES)
def test_lora_estimate_within_2_and_3_percent_of_the_real_step(name, prec, dropout):
    """[-2%, +3%] of the measured peak: the frozen layers keep no inputs, the first layer's
    inputs need no gradient (its dropout keeps no mask), each adapter keeps its input as
    lora_A reads it and its rank-r output (fp32 adapters under autocast)."""
    _, real = _measured(name, prec, dropout)
    est = estimate_hf(CONFIGS[name], seq=SEQ, batch=BATCH, precision=prec, target="cpu",
                      lora=_lora(name, dropout))
    assert -0.02 <= est.peak_bytes / real.peak_bytes - 1 <= 0.03, (est.peak_bytes, real.peak_bytes)
    # model states: the frozen base and the adapters, the adapters' AdamW moments (8 B each)
    assert est.by_category["parameters"] == real.by_category["parameters"]
    assert est.by_category["optimizer"] == pytest.approx(real.by_category["optimizer"], abs=256)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "phi3", "gpt2", "deepseek_v3"])
def test_adapters_are_the_ones_peft_makes(name):
    """all-linear (or the MoE's attention targets) names the modules peft adapts: the same
    trainable count, tensor for tensor."""
    model, _ = _measured(name, "fp32", 0.0)
    peft = sorted(p.numel() for p in model.parameters() if p.requires_grad)
    s = decoder_shape(CONFIGS[name])
    ours = sorted(r * c for r, c in adapter_shapes(s, adapters_for(s, _lora(name, 0.0), "fp32")))
    assert ours == peft


def test_unknown_target_names_the_modules_of_the_family():
    with pytest.raises(InputError, match=r"\['wq'\] \(phi3\); allowed: down_proj, gate_up_proj, o_proj, qkv_proj"):
        estimate_hf(FAMILIES["phi3"], seq=SEQ, batch=BATCH, lora=LoraConfig(targets=("wq",)))
    with pytest.raises(InputError, match="dropout=1.5"):
        LoraConfig(dropout=1.5)


@pytest.mark.parametrize("name", ["qwen3-8b", "phi-3-mini", "gemma-3-12b", "gpt-oss-20b", "deepseek-v3"])
def test_every_family_takes_lora_and_qlora_in_the_cli(name, capsys):
    """Families memlab's GPT cannot map (refused before with "has no memlab GPT equivalent")
    answer LoRA and QLoRA; QLoRA's base is smaller than bf16's by the packed linears."""
    common = ["estimate", "--hf-config", name, "--seq", "512", "--batch", "1", "--precision", "bf16",
              "--lora-rank", "16", "--json"]
    if name in ("gpt-oss-20b", "deepseek-v3"):
        common += ["--lora-targets", "o_proj"]
    assert main(common) == 0
    lora = json.loads(capsys.readouterr().out)
    assert main([*common, "--load-in-4bit"]) == 0
    qlora = json.loads(capsys.readouterr().out)
    assert qlora["by_category"]["parameters"] < lora["by_category"]["parameters"]
    assert lora["config"]["lora"]["rank"] == 16 and qlora["config"]["quantization"]["bits"] == 4


def test_qlora_trainer_and_deepspeed_configs_answer(tmp_path, capsys):
    """The issue's command: Qwen3-8B, QLoRA r=16, a TRL SFTConfig and a ZeRO-2 config."""
    sft = tmp_path / "sft.yaml"
    sft.write_text("per_device_train_batch_size: 2\ngradient_accumulation_steps: 4\nbf16: true\n"
                   "gradient_checkpointing: true\nmax_length: 2048\noptim: adamw_torch\n")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                              "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}))
    assert main(["estimate", "--hf-config", "qwen3-8b", "--load-in-4bit", "--lora-rank", "16",
                 "--training-args", str(sft), "--deepspeed", str(ds), "--world-size", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = out["config"]
    assert (cfg["zero"], cfg["world_size"], cfg["micro_batches"], out["seq"]) == (2, 8, 4, 2048)
    assert cfg["checkpointing"] == "full" and cfg["quantization"]["bits"] == 4
