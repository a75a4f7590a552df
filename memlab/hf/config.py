"""Hugging Face models from their ``config.json``: no download, no weights.

A Hugging Face model is fully described, for memory, by its ``config.json``. This module
reads one (a file, or a folder holding one) and gives the two lenses what they need:

* :func:`load_config` reads it (a path, a folder or a :data:`SHIPPED` name), checked; the
  estimate reads its decoder's shape (:func:`memlab.hf.shape.decoder_shape`).
* :func:`build_fn` builds the real ``transformers`` class (``AutoModelForCausalLM``), on
  fake tensors for :func:`memlab.hf.simulate.simulate_hf` (through
  :func:`memlab.lenses.your_model.simulate_model`), so any causal LM whose code ``transformers`` has
  can be simulated, and real for :func:`memlab.hf.measure.measure_hf`.

The published ``config.json`` of Llama-3-8B, Qwen2.5-7B, Mistral-7B-v0.1 and
GPT-2 ship in ``memlab/data/hf_configs`` (:data:`SHIPPED`).
"""
from __future__ import annotations

import contextlib
import json
import pathlib
import warnings
from importlib import resources
from typing import Callable, Iterator

import torch

from memlab.core.errors import InputError
from memlab.core.torch_private import FakeCopyMode, FakeTensor, fake_grouped_mm_any_dtype, parse_to
from memlab.hf.config_check import check_config, expert_count, field_value
from memlab.models.chunked_loss import linear_cross_entropy
from memlab.step.optimizer_in_backward import OptimizerInBackward
from memlab.step.training_step import DECODER_CHECKPOINTING, DECODER_LOSSES, autocast_for

#: Shipped configs: name -> file in memlab/data/hf_configs.
SHIPPED = {name: f"{name}.json" for name in (
    "llama-3-8b", "qwen2.5-7b", "mistral-7b", "gpt2",
    # today's models: published config.json files (Gemma 3: the text model of gemma-3-12b-pt)
    "llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "gemma-3-12b",
    "mistral-nemo-12b", "phi-3-mini", "deepseek-v3", "gpt-oss-20b")}


def shipped_config(name: str) -> dict:
    """One of the shipped published configs (:data:`SHIPPED`) as a dict.

    A dict because it is a Hugging Face ``config.json``, as published.
    """
    if name not in SHIPPED:
        raise InputError(f"no shipped config {name!r}; allowed: {', '.join(SHIPPED)}")
    text = resources.files("memlab").joinpath("data", "hf_configs", SHIPPED[name]).read_text()
    return json.loads(text)


def load_config(path: str | pathlib.Path | dict, *, checked: bool = True) -> dict:
    """A ``config.json`` as a dict: ``path`` is the file, a folder holding it, the name of a
    shipped config (``"llama-3-8b"``), or already a dict. ``checked``: every field memlab reads
    checked and transformers' fixed defaults of left-out ones written in
    (:func:`memlab.hf.config_check.check_config`); False: as read.

    A dict because it is a Hugging Face ``config.json``, which transformers reads.
    """
    if isinstance(path, dict):
        cfg = dict(path)
    elif str(path) in SHIPPED:
        cfg = shipped_config(str(path))
    else:
        p = pathlib.Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise InputError(f"--hf-config {str(path)!r}: no such config.json; allowed: a "
                             f"config.json file, a folder holding one, or {', '.join(SHIPPED)}")
        try:
            cfg = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise InputError(f"--hf-config {str(p)!r} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise InputError(f"--hf-config {str(path)!r} has no model_type; allowed: a Hugging Face "
                         f"config.json")
    return check_config(cfg).config if checked else cfg


def rope_parameters(cfg: dict) -> dict:
    """The config's rope scaling (``rope_scaling``, which transformers 5 calls
    ``rope_parameters``), or an empty dict.

    A dict because it is a section of a Hugging Face ``config.json``.
    """
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def context_length(cfg: dict | str | pathlib.Path) -> int:
    """The longest sequence the model is configured for: ``max_position_embeddings``
    (GPT-2: ``n_positions``), or, where the rope scaling names the context it stretches
    (``original_max_position_embeddings``, as YaRN and Llama 3's scaling do), ``factor``
    times that context if larger (Qwen3's card: YaRN factor 4 on 32,768 tokens gives 131,072).
    A factor without the original context is not applied: Gemma 3 and Llama 3.1 already give
    the stretched length as ``max_position_embeddings``."""
    cfg = load_config(cfg)
    context = int(field_value(cfg, "max_position_embeddings", "n_positions"))
    rope = rope_parameters(cfg)
    if rope.get("original_max_position_embeddings") and rope.get("factor"):
        context = max(context, int(rope["factor"] * rope["original_max_position_embeddings"]))
    return context


def check_seq(cfg: dict, seq: int | None) -> None:
    """Refuse a sequence longer than the model's context (:func:`context_length`)."""
    context = context_length(cfg)
    if seq is not None and not 1 <= seq <= context:
        raise InputError(f"seq {seq} exceeds the model's context of {context} tokens "
                         f"(max_position_embeddings, rope-scaled where the config says so); "
                         f"allowed: 1-{context}")


def is_moe(cfg: dict) -> bool:
    """Whether the config routes tokens to experts (any of the fields transformers' mixtures
    of experts use for the number of routed experts)."""
    return expert_count(cfg) > 1


#: How the simulation routes tokens, said in every mixture-of-experts report.
ROUTING_NOTE = ("experts: transformers' grouped_mm implementation, one grouped GEMM over all "
                "tokens x top-k (token, expert) pairs, so the bytes do not depend on which experts "
                "the router picks; on fake tensors the GEMM is torch's own _grouped_mm in every "
                "dtype (its meta kernel's bf16-only check is stepped past, as the CPU kernel takes "
                "fp32), so its backward saves what the real one saves")


@contextlib.contextmanager
def fake_grouped_mm() -> Iterator[None]:
    """While open, fake experts run transformers' own dispatch to ``torch._grouped_mm`` in any
    dtype (:func:`memlab.core.torch_private.fake_grouped_mm_any_dtype`): its meta kernel refuses
    anything but bf16 ("Expected inputs of BF16 type"), while the real fp32 step runs the op on
    the CPU. transformers' own fallback op (``grouped_mm_fallback``, taken when
    ``_can_use_grouped_mm`` says no) is not the real step's: its ``setup_context`` saves the
    input and the weight always (``integrations/moe.py`` line 232, transformers 5.23), where
    torch's ``GroupedMmBackward0`` saves the input only for the weight's gradient, so frozen
    experts under LoRA kept every routed input and every SwiGLU product alive."""
    with fake_grouped_mm_any_dtype():
        yield


def attn_implementation(conf, attention: str | None) -> str:
    """HF's attention implementation for memlab's ``attention`` (``naive`` -> ``eager``,
    ``sdpa``), asked of the model class: left out, SDPA where the class supports it, else
    eager (Gemma 2: SDPA has no logit softcapping); ``sdpa`` on a class without it is refused."""
    from transformers import AutoModelForCausalLM
    try:
        cls = AutoModelForCausalLM._model_mapping[type(conf)]
    except KeyError:
        raise InputError(f"model_type {conf.model_type!r} has no causal LM class in transformers") from None
    sdpa = bool(getattr(cls, "_supports_sdpa", False))
    if attention == "naive" or (attention is None and not sdpa):
        return "eager"
    if attention not in (None, "sdpa"):
        raise InputError(f"attention={attention!r} for a Hugging Face model; allowed: naive, sdpa")
    if not sdpa:
        raise InputError(f"attention='sdpa': {cls.__name__} does not support SDPA in transformers; "
                         f"allowed: naive (eager)")
    return "sdpa"


def hf_config(cfg: dict | str | pathlib.Path):
    """The ``transformers`` config object (no network: built from the dict)."""
    from transformers import AutoConfig
    d = dict(load_config(cfg))  # a copy: the model_type popped below is the caller's
    check_config(d, construct=True)  # transformers' own refusals as InputError, before building
    d.pop("transformers_version", None)
    kind = d.pop("model_type")
    try:
        conf = AutoConfig.for_model(kind, **d)
    except ValueError as e:
        raise InputError(f"model_type {kind!r} is unknown to transformers ({e})") from None
    return conf


def enable_hf_checkpointing(model) -> None:
    """HF's own per-layer checkpointing, non-reentrant: ``activation_checkpointing_enable``
    (transformers >= 5.x), which older releases call ``gradient_checkpointing_enable``."""
    kw = {"use_reentrant": False}
    # training keeps no KV cache; with the config's use_cache=True every forward would log
    # "`use_cache=True` is incompatible with gradient checkpointing" and turn it off itself
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def add_lora(model, lora: dict, autocast_adapter_dtype: bool = True):
    """``peft.get_peft_model(model, LoraConfig(**lora))``, also on fake tensors: peft moves
    each new adapter to its base layer's device and dtype with ``Module.to``, which swaps
    parameters and cannot swap fake ones; there, while the adapters are made, ``Module.to``
    puts converted copies in place instead (the same tensors, the same bytes).
    ``autocast_adapter_dtype``: peft's own (True: adapters of a 16-bit base in fp32)."""
    from peft import LoraConfig
    if not isinstance(next(model.parameters()), FakeTensor):
        return peft_model(model, LoraConfig(**lora), autocast_adapter_dtype)
    to = torch.nn.Module.to
    torch.nn.Module.to = _replacing_to
    try:
        # modules_to_save (a SEQ_CLS task's score) are deep copies, which would otherwise land in
        # a fake mode of their own
        with FakeCopyMode(next(model.parameters()).fake_mode):
            return peft_model(model, LoraConfig(**lora), autocast_adapter_dtype)
    finally:
        torch.nn.Module.to = to


def peft_model(model, config, autocast_adapter_dtype: bool = True):
    """``peft.get_peft_model(model, config)`` without the deprecation warning peft itself
    triggers: it reads ``model.is_gradient_checkpointing``, which transformers 5 renamed
    ``is_activation_checkpointing`` and warns about (a FutureWarning the caller cannot avoid;
    only that one is silenced)."""
    from peft import get_peft_model
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return get_peft_model(model, config, autocast_adapter_dtype=autocast_adapter_dtype)


def _replacing_to(module: torch.nn.Module, *args, **kwargs) -> torch.nn.Module:
    """``Module.to`` that replaces parameters and buffers rather than swapping them."""
    device, dtype = parse_to(*args, **kwargs)
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for k, t in table.items():
                if t is None:
                    continue
                new = t.detach().to(device=device or t.device,
                                    dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
                table[k] = torch.nn.Parameter(new, t.requires_grad) if table is m._parameters else new
    return module


def build_fn(cfg: dict | str | pathlib.Path, *, precision: str = "fp32",
             checkpointing: str | None = None, attention: str | None = None,
             lora: dict | None = None, lr: float = 1e-4, dtype: torch.dtype | None = None,
             prepare: Callable | None = None, autocast_adapter_dtype: bool = True,
             optimizer: Callable | None = None, optimizer_in_backward: bool = False,
             reward_head: bool = False) -> Callable:
    """A ``build_fn`` for :func:`memlab.simulate_model`: the HF causal LM (with ``reward_head``
    the sequence classifier with one label a reward model is, its pad id 0, LoRA's task
    ``SEQ_CLS`` training its ``score``) (fp32 master
    weights, or bf16 ones for ``pure-bf16``; ``dtype`` overrides), ``prepare(model)`` applied
    to it (a quantised base: :func:`memlab.hf.simulate.quantize_base`), HF's own gradient
    checkpointing for ``checkpointing="full"``, LoRA adapters from ``lora`` (``peft.LoraConfig``
    keywords; ``autocast_adapter_dtype`` peft's own), and ``optimizer(params)`` over the
    trainable parameters (default: a fused AdamW); with ``optimizer_in_backward`` one such
    optimizer per parameter, stepped in backward (:class:`memlab.step.optimizer_in_backward.OptimizerInBackward`)."""
    if (checkpointing or "none") not in DECODER_CHECKPOINTING:
        raise InputError(f"checkpointing={checkpointing!r} for a Hugging Face model; allowed: "
                         f"{', '.join(DECODER_CHECKPOINTING)} (HF checkpoints whole decoder layers)")
    conf = hf_config(cfg)
    attn = attn_implementation(conf, attention)

    if reward_head:
        conf.num_labels, conf.pad_token_id = 1, 0

    def build():
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
        weights = dtype or (torch.bfloat16 if precision == "pure-bf16" else torch.float32)
        cls = AutoModelForSequenceClassification if reward_head else AutoModelForCausalLM
        model = cls.from_config(conf, dtype=weights, attn_implementation=attn)
        model.train()
        if prepare is not None:
            model = prepare(model)
        if checkpointing == "full":
            enable_hf_checkpointing(model)
        if lora is not None:
            model = add_lora(model, dict(lora, task_type="SEQ_CLS") if reward_head else lora, autocast_adapter_dtype)
        params = [p for p in model.parameters() if p.requires_grad]
        make = optimizer or (lambda ps: torch.optim.AdamW(ps, lr=lr, fused=True))
        if optimizer_in_backward:
            return model, OptimizerInBackward(params, make)
        return model, make(params)
    return build


def causal_lm_step(seq: int, batch: int, precision: str = "fp32", vocab: int | None = None,
                   micro_batches: int = 1, *, loss: str = "transformers", loss_chunk: int = 1024) -> Callable:
    """A ``step_fn(model, optimizer)``: ``micro_batches`` forwards and backwards of
    ``batch / micro_batches`` random sequences under the precision's autocast (on the model's
    device type), each loss divided by the micro-batches as the Trainer scales it, the gradients
    accumulating; one step, ``zero_grad(set_to_none=True)``.

    ``loss="transformers"``: ``model(input_ids, labels).loss``, the class's own (its logits
    upcast to fp32). ``loss="chunked"``: the decoder's final hidden states and the head's
    weight into :func:`memlab.models.chunked_loss.linear_cross_entropy` (``loss_chunk`` tokens at a
    time), each token predicting the next one (the last wraps to the first: random tokens, the
    same bytes), as a training loop that never makes the logits writes it.

    Raises:
        InputError: a ``loss`` not in :data:`memlab.step.training_step.DECODER_LOSSES`.
    """
    if loss not in DECODER_LOSSES:
        raise InputError(f"loss={loss!r}; allowed: {', '.join(DECODER_LOSSES)}")
    k = micro_batches

    def step(model, optimizer):
        device = next(model.parameters()).device
        v = vocab or model.config.vocab_size
        for _ in range(k):
            ids = torch.randint(0, v, (batch // k, seq), device=device)
            with autocast_for(precision, device):
                if loss == "chunked":
                    hidden = model.get_decoder()(input_ids=ids).last_hidden_state
                    out = linear_cross_entropy(hidden.flatten(0, 1), model.get_output_embeddings().weight,
                                               ids.roll(-1, dims=1).flatten(), chunk_size=loss_chunk)
                else:
                    out = model(input_ids=ids, labels=ids).loss
            (out / k if k > 1 else out).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


__all__ = ["SHIPPED", "ROUTING_NOTE", "shipped_config", "load_config",
           "rope_parameters", "context_length", "check_seq", "is_moe", "fake_grouped_mm", "attn_implementation",
           "hf_config", "enable_hf_checkpointing", "add_lora", "peft_model",
           "build_fn", "causal_lm_step"]
