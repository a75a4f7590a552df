"""The time lens's FLOPs of a Hugging Face decoder from its shape (memlab.time.flops.decoder_step_flops)
against torch's FlopCounterMode on the real transformers model, built small from the shipped
config of each family (its own config class fills in the rest; nothing is downloaded)."""
import pathlib
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from memlab.core.errors import InputError
from memlab.hf import config as hf
from memlab.hf.shape import decoder_shape
from memlab.step.fine_tune_config import LoraConfig
from memlab.step.training_step import StepConfig
from memlab.time.flops import CPU_SDPA, decoder_step_flops, step_flops_formula

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from hf_families import FAMILIES  # noqa: E402

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)


def shrink(name: str, **more) -> dict:
    """A shipped config at small widths: its structure (norms, biases, tied head, experts) kept."""
    d = hf.load_config(name, checked=False)
    d.update(SMALL if d["model_type"] != "gpt2" else dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128))
    d.update(more)
    return d


CASES = {
    "llama": lambda: shrink("llama-3.1-8b"),
    "qwen3": lambda: shrink("qwen3-8b", head_dim=24),               # head_dim apart from d / heads
    "gemma3": lambda: shrink("gemma-3-12b", head_dim=24, sliding_window=16),
    "gemma2": lambda: FAMILIES["gemma2"],                           # eager, softcapped, post-norms
    "phi3": lambda: shrink("phi-3-mini", num_key_value_heads=4, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2),                         # fused qkv and gate_up
    "gpt2": lambda: shrink("gpt2"),                                 # Conv1D, dropout: SDPA's math path
    "mixtral": lambda: shrink("mixtral-8x7b", num_local_experts=4),
    "qwen3_moe": lambda: shrink("qwen3-30b-a3b", num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, head_dim=16),
    "deepseek_v3": lambda: FAMILIES["deepseek_v3"],                 # MLA: q/k and v head dims differ
}
SEQ, BATCH = 32, 2


def counted(d: dict, ckpt: str, lora: LoraConfig | None = None) -> tuple[int, str]:
    """FlopCounterMode's total over one real step (after a warm-up step), and the attention
    the CPU ran (``naive``: eager matmuls or SDPA's math composite; ``sdpa``: the flash kernel).
    Routed experts run transformers' ``eager`` experts (one ``F.linear`` per expert on its
    tokens), whose matmuls torch counts; its grouped GEMM has no formula in torch."""
    from transformers import AutoModelForCausalLM
    s = decoder_shape(d)
    conf = hf.hf_config(d)
    attn = hf.attn_implementation(conf, None)
    extra = dict(experts_implementation="eager") if s.experts else {}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(conf, attn_implementation=attn, **extra)
    model.train()
    if ckpt == "full":
        hf.enable_hf_checkpointing(model)
    if lora is not None:
        model = hf.add_lora(model, lora.peft_kwargs(s.linear_names()))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    step = hf.causal_lm_step(SEQ, BATCH)
    step(model, opt)
    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
        step(model, opt)
    naive = attn == "eager" or s.attn_dropout > 0 or s.head_dim != s.v_head_dim  # CPU: math path
    return counter.get_total_flops(), "naive" if naive else "sdpa"


@pytest.mark.parametrize("ckpt", ["none", "full"])
@pytest.mark.parametrize("family", list(CASES))
def test_decoder_flops_equal_flop_counter(family, ckpt):
    d = CASES[family]()
    total, attention = counted(d, ckpt)
    f = decoder_step_flops(decoder_shape(d), SEQ, BATCH, checkpointing=ckpt, attention=attention)
    assert f.total == total, (f.total, total)


@pytest.mark.parametrize(("family", "targets"), [
    ("llama", ("q_proj", "v_proj")), ("llama", ("o_proj", "down_proj")), ("llama", "all-linear"),
    ("qwen3", ("v_proj",)), ("phi3", ("qkv_proj",)), ("phi3", "all-linear"), ("gpt2", ("c_proj",)),
    ("mixtral", "all-linear")])
def test_decoder_lora_flops_equal_flop_counter(family, targets):
    d = CASES[family]()
    lora = LoraConfig(rank=4, targets=targets)
    total, attention = counted(d, "none", lora)
    s = decoder_shape(d)
    f = decoder_step_flops(s, SEQ, BATCH, attention=attention, lora_rank=4,
                           lora_targets=s.linear_names() if targets == "all-linear" else targets)
    assert f.total == total, (f.total, total)


def test_the_run_reads_its_shape():
    """step_flops_formula of a StepConfig with a DecoderShape is the decoder's closed form."""
    s = decoder_shape(CASES["llama"]())
    run = StepConfig(s, seq=SEQ, batch=BATCH, checkpointing="full", lora=LoraConfig(rank=4, targets=("q_proj",)))
    assert step_flops_formula(run) == decoder_step_flops(s, SEQ, BATCH, checkpointing="full", lora_rank=4,
                                                         lora_targets=("q_proj",))


def test_bad_input_is_named():
    s = decoder_shape(CASES["llama"]())
    with pytest.raises(InputError, match="checkpointing='selective'"):
        decoder_step_flops(s, 8, 1, checkpointing="selective")
    with pytest.raises(InputError, match="nope"):
        decoder_step_flops(s, 8, 1, lora_rank=4, lora_targets=("nope",))
    with pytest.raises(InputError, match="latent"):
        decoder_step_flops(decoder_shape(FAMILIES["deepseek_v3"]), 8, 1, lora_rank=4, lora_targets=("o_proj",))
