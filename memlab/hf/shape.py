"""A Hugging Face decoder's config read into what its memory depends on.

:func:`decoder_shape` turns the ``config.json`` of any of :data:`FAMILIES` (with the family's
config class filling in its defaults) into a :class:`DecoderShape`: widths, heads and head
dims, norms, biases, fused projections, tied head, dropout, sliding windows and softcaps,
multi-head latent attention (DeepSeek) and mixtures of experts (routed and shared experts,
top-k, the dense first layers, the router). :meth:`DecoderShape.num_params` is the real
class's parameter count; a field the closed form cannot count is refused, named, with
``memlab simulate --hf-config`` pointed at. :mod:`memlab.lenses.decoder_estimate` counts the bytes;
:class:`DecoderShape` itself lives in :mod:`memlab.models.decoder_shape`.
"""
from __future__ import annotations

import pathlib

from memlab.core.errors import InputError
from memlab.hf.config import attn_implementation, context_length, hf_config, load_config
from memlab.hf.config_check import expert_count, field_value, recorded
from memlab.models.decoder_shape import DecoderShape

#: model_type -> the family's layout; these are what the closed form counts.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2",
            "mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
#: what a config the closed form cannot read is told (field_value's hint)
SIMULATE_HINT = "; the estimate needs it (memlab simulate --hf-config builds the model itself)"


def _need(cfg: dict, *names: str):
    return field_value(cfg, *names, hint=SIMULATE_HINT)


def _refuse(cfg: dict, field: str, why: str) -> InputError:
    return InputError(f"{field}={cfg.get(field)!r} ({cfg['model_type']}): {why}; the closed form "
                      f"does not count it (use memlab simulate --hf-config, which runs the model)")


def _class_view(given: dict) -> dict:
    """What transformers' classes say of a config: its config object as a dict, and whether
    the model class has only eager attention."""
    conf = hf_config(given)
    return {"config": conf.to_dict(), "eager_only": attn_implementation(conf, None) == "eager"}


def decoder_shape(cfg: dict | str | pathlib.Path) -> DecoderShape:
    """The :class:`DecoderShape` of a config (a dict, a config.json, its folder or a shipped
    name); model types outside :data:`FAMILIES` and fields the closed form cannot count are
    refused with the field named.

    Over 80 lines because it reads each config field the closed form counts once, one field (and its
    refusal) a line.
    """
    given = load_config(cfg)
    kind = given["model_type"]
    if kind not in FAMILIES:
        raise InputError(f"model_type {kind!r}: the estimate counts {', '.join(FAMILIES)} "
                         f"(memlab simulate --hf-config builds any causal LM transformers has)")
    # the family's config class fills in its defaults (gpt-oss: attention biases; Gemma 2: softcaps)
    view = recorded("shape", given, lambda: _class_view(given))
    cfg = {**view["config"], **{k: v for k, v in given.items() if v is not None}}
    cfg["model_type"] = kind
    name = cfg.get("_name_or_path") or (cfg.get("architectures") or [kind])[0]
    if kind == "gpt2":
        d, heads = _need(cfg, "n_embd"), _need(cfg, "n_head")
        if cfg.get("activation_function", "gelu_new") != "gelu_new":
            raise _refuse(cfg, "activation_function", "only GPT-2's gelu_new is counted")
        return DecoderShape(kind, name, _need(cfg, "n_layer"), d, _need(cfg, "vocab_size"), heads,
                            heads, d // heads, d // heads, cfg.get("n_inner") or 4 * d,
                            cfg.get("tie_word_embeddings", True), norm="layer", qkv_bias=True,
                            o_bias=True, fused_qkv=True, mlp="gelu_new", mlp_bias=True,
                            positions=_need(cfg, "n_positions"),
                            attn_dropout=cfg.get("attn_pdrop", 0.1), resid_dropout=cfg.get("resid_pdrop", 0.1),
                            embd_dropout=cfg.get("embd_pdrop", 0.1), context=context_length(given),
                            use_cache=bool(cfg.get("use_cache", True)))
    d, heads = _need(cfg, "hidden_size"), _need(cfg, "num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or d // heads
    L = _need(cfg, "num_hidden_layers")
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh", "gelu"):
        raise _refuse(cfg, "hidden_act", "only SiLU and GELU gated MLPs are counted")
    for field in ("attention_dropout", "resid_pdrop", "embd_pdrop"):
        if field in ("resid_pdrop", "embd_pdrop") and kind != "phi3":
            continue
        if (cfg.get(field) or 0) > 0 and not (kind == "phi3" or field == "attention_dropout"):
            raise _refuse(cfg, field, "dropout is counted for GPT-2 and Phi-3")
    gemma = kind.startswith("gemma")
    common = dict(context=context_length(given), use_cache=bool(cfg.get("use_cache", True)),
                  norm="gemma" if gemma else "rms", norms_per_layer=4 if kind in ("gemma2", "gemma3_text") else 2,
                  qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3_text"),
                  qkv_bias=bool(cfg.get("attention_bias", kind == "qwen2")) or kind == "qwen2",
                  o_bias=bool(cfg.get("attention_bias", False)) and kind not in ("qwen2",),
                  mlp_bias=bool(cfg.get("mlp_bias", False)),
                  fused_qkv=kind == "phi3", fused_gate_up=kind == "phi3",
                  attn_dropout=cfg.get("attention_dropout") or 0.0,
                  resid_dropout=cfg.get("resid_pdrop") or 0.0 if kind == "phi3" else 0.0,
                  embd_dropout=cfg.get("embd_pdrop") or 0.0 if kind == "phi3" else 0.0,
                  attn_softcap=cfg.get("attn_logit_softcapping", 50.0 if kind == "gemma2" else None),
                  eager_only=view["eager_only"], sinks=kind == "gpt_oss")
    if kind == "gemma3_text":
        common["attn_softcap"] = cfg.get("attn_logit_softcapping")
    common["final_softcap"] = cfg.get("final_logit_softcapping") if gemma else None
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window:
        types = cfg.get("layer_types") or ["sliding_attention"] * L
        common.update(window=window, sliding_layers=tuple(i for i, k in enumerate(types)
                                                          if k == "sliding_attention"))
    if common["attn_softcap"] and kind != "gemma2":
        raise _refuse(cfg, "attn_logit_softcapping", "softcapping is counted for Gemma 2")
    ffn = cfg.get("intermediate_size") or 0
    tied = bool(cfg.get("tie_word_embeddings", gemma))
    moe = {}
    experts = expert_count(cfg)
    if experts > 1:
        top_k = _need(cfg, "num_experts_per_tok", "experts_per_token")
        moe_ffn = cfg.get("moe_intermediate_size") or ffn
        if kind == "qwen3_moe":
            step = cfg.get("decoder_sparse_step") or 1
            only = set(cfg.get("mlp_only_layers") or ())
            layers = tuple(i for i in range(L) if i not in only and (i + 1) % step == 0)
        elif kind == "deepseek_v3":
            first, freq = cfg.get("first_k_dense_replace") or 0, cfg.get("moe_layer_freq") or 1
            layers = tuple(i for i in range(L) if i >= first and i % freq == 0)
        else:
            layers = tuple(range(L))
        moe = dict(experts=experts, top_k=top_k, moe_ffn=moe_ffn, moe_layers=layers,
                   shared_ffn=(cfg.get("n_shared_experts") or 0) * moe_ffn,
                   router={"deepseek_v3": "sigmoid_group", "gpt_oss": "topk_softmax"}.get(kind, "softmax"),
                   router_groups=cfg.get("n_group") or 1, router_topk_groups=cfg.get("topk_group") or 1,
                   expert_bias=kind == "gpt_oss", gate="clamped_glu" if kind == "gpt_oss" else "glu")
    elif kind in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"):
        raise _refuse(cfg, "num_experts", f"a {kind} config without experts")
    mla = {}
    if kind == "deepseek_v3":
        rope, nope = _need(cfg, "qk_rope_head_dim"), _need(cfg, "qk_nope_head_dim")
        hd = rope + nope
        mla = dict(q_lora_rank=cfg.get("q_lora_rank"), kv_lora_rank=_need(cfg, "kv_lora_rank"),
                   qk_rope_dim=rope)
        kv = heads
    v_hd = cfg.get("v_head_dim") or hd
    return DecoderShape(kind, name, L, d, _need(cfg, "vocab_size"), heads, kv, hd, v_hd, ffn, tied,
                        **common, **moe, **mla)


__all__ = ["FAMILIES", "decoder_shape"]
