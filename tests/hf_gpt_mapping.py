"""memlab's GPT of the same shapes as a Hugging Face config: a second lens for the tests.

memlab's estimate of a Hugging Face config reads its decoder's shape
(:func:`memlab.hf.shape.decoder_shape`); these tests build memlab's own GPT of the same
shapes (Llama, Mistral and Qwen2: SwiGLU, RMSNorm, rotary positions, grouped-query attention,
Qwen2's q/k/v biases; GPT-2: GELU, LayerNorm, learned positions, tied head) to check memlab's
GPT counting against the real Hugging Face class, peft's adapters and published runs.
Hugging Face computes the rotary ``cos``/``sin`` for each forward's tokens, so ``block_size``
is the step's sequence length (the context still bounds it).
"""
from __future__ import annotations

import pathlib

from memlab.hf.config import check_seq, context_length, load_config
from memlab.hf.config_check import field_value
from memlab.models.gpt_unet import GPTConfig
from memlab.step.training_step import StepConfig

#: the model_types memlab's GPT has the shapes of
SUPPORTED = ("llama", "mistral", "qwen2", "gpt2")


def gpt_config(cfg: dict | str | pathlib.Path, seq: int | None = None) -> GPTConfig:
    """memlab's GPT of the same shapes as a Hugging Face config (see the module doc);
    ``seq`` sets ``block_size`` (HF's per-forward rotary tables), checked against the context."""
    cfg = load_config(cfg)
    kind = cfg["model_type"]
    if kind not in SUPPORTED:
        raise ValueError(f"model_type {kind!r}: memlab's GPT has the shapes of {', '.join(SUPPORTED)}")
    context = context_length(cfg)
    check_seq(cfg, seq)
    name = cfg.get("_name_or_path") or (cfg.get("architectures") or [kind])[0]
    if kind == "gpt2":
        return GPTConfig(n_layer=field_value(cfg, "n_layer"), n_head=field_value(cfg, "n_head"),
                         d_model=field_value(cfg, "n_embd"), vocab_size=field_value(cfg, "vocab_size"),
                         block_size=context, mlp_hidden=cfg.get("n_inner"), name=name)
    d, heads = field_value(cfg, "hidden_size"), field_value(cfg, "num_attention_heads")
    if cfg.get("head_dim") not in (None, d // heads):
        raise ValueError(f"head_dim={cfg['head_dim']} differs from hidden_size/num_attention_heads = {d // heads}")
    return GPTConfig(n_layer=field_value(cfg, "num_hidden_layers"), n_head=heads, d_model=d,
                     vocab_size=field_value(cfg, "vocab_size"), block_size=seq or context, mlp="swiglu",
                     mlp_hidden=field_value(cfg, "intermediate_size"), norm="rmsnorm", position="rope",
                     bias=False, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                     name=name, n_kv_head=cfg.get("num_key_value_heads") or heads,
                     qkv_bias=True if kind == "qwen2" else bool(cfg.get("attention_bias", False)),
                     rope_theta=float(10000.0 if cfg.get("rope_theta") is None else cfg["rope_theta"]))


def step_config(cfg: dict | str | pathlib.Path, *, seq: int, batch: int, precision: str = "fp32",
                checkpointing: str | None = None, attention: str | None = None, **more) -> StepConfig:
    """A :class:`StepConfig` of the mapped GPT, for :func:`memlab.estimate_step`."""
    return StepConfig(model=gpt_config(cfg, seq), seq=seq, batch=batch, precision=precision,
                      checkpointing=checkpointing, attention=attention, **more)
