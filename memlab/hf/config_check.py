"""A Hugging Face ``config.json`` checked before anything is built from it.

A learner's ``config.json`` is often edited by hand. :func:`check_config` reads every field
memlab's lenses read (:data:`FIELDS`) and refuses, with an :class:`~memlab.core.errors.InputError`
naming the field, its value and what is allowed, a value that would otherwise surface as a
traceback deep in ``transformers`` or torch (a negative width, heads that do not divide it,
more experts per token than experts, ...). It also says which fields the config leaves to
``transformers``' defaults: a partial config (``{"model_type": "llama", "hidden_size": 512}``)
builds a model whose other sizes are the config class's defaults (32 layers, a 32k
vocabulary), and :attr:`CheckedConfig.note` names them with their values.

Defaults come from ``transformers``' own config class (``CONFIG_MAPPING[model_type]``,
constructed from the file, so a default computed from other fields is the class's own). A
default that is a fixed number of the class is written into :attr:`CheckedConfig.config`, so
the estimate reads the same model the simulation builds; one the class computes from other
fields (``num_key_value_heads`` = heads for Llama) is noted and left to it.

Imports nothing from memlab but :class:`~memlab.core.errors.InputError`; ``transformers`` only when
the config needs its class (see :func:`check_config`), and not even then for a shipped config:
transformers' answers about those (this check, and :func:`memlab.hf.shape.decoder_shape`'s
defaults) are recorded in ``memlab/data/hf_resolved.json``, keyed by the input and used only
under the transformers version that wrote them (:func:`recorded`; ``tools/record_hf.py``
rewrites it, ``tests/test_hf_config_check.py`` checks it is what transformers says). Importing
transformers costs seconds, more than the whole estimate.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from importlib import metadata, resources
from typing import Any, Callable, Iterator

from memlab.core.errors import InputError

#: The largest count a field may hold: 2^31 - 1. Two such sizes multiply to under 2^62
#: elements, so no weight's element count overflows torch's 64-bit sizes.
MAX_COUNT = 2**31 - 1
#: A model_type is a name (``llama``, ``qwen3_moe``, ``gpt-sw3``), never code.
MODEL_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


@dataclass(frozen=True)
class Field:
    """One field memlab reads: its spellings in a ``config.json`` (transformers'
    ``attribute_map`` aliases, the first is the canonical name) and what it may hold."""
    names: tuple[str, ...]
    kind: str  # count | count0 | bool | positive | name | names | layers | rope
    core: bool = False  # every lens needs it (the estimate refuses a config without it)
    noted: bool = True  # named in the defaults note when left out (sizes, the tied head)

    @property
    def name(self) -> str:
        return self.names[0]


#: Every field memlab reads from a config.json (hf.py, the estimate, the simulation).
FIELDS: tuple[Field, ...] = (
    Field(("vocab_size",), "count", core=True),
    Field(("hidden_size", "n_embd", "d_model"), "count", core=True),
    Field(("num_hidden_layers", "n_layer", "num_layers"), "count", core=True),
    Field(("num_attention_heads", "n_head", "num_heads"), "count", core=True),
    Field(("max_position_embeddings", "n_positions"), "count", core=True),
    Field(("intermediate_size", "n_inner", "d_ff"), "count"),
    Field(("num_key_value_heads",), "count"),
    Field(("head_dim", "d_kv"), "count"),
    Field(("num_experts", "num_local_experts", "n_routed_experts"), "count"),
    Field(("num_experts_per_tok",), "count"),
    Field(("moe_intermediate_size",), "count"),
    Field(("n_shared_experts",), "count0"),
    Field(("first_k_dense_replace",), "count0"),
    Field(("decoder_sparse_step",), "count"),
    Field(("n_group",), "count"),
    Field(("topk_group",), "count"),
    Field(("q_lora_rank",), "count"),
    Field(("kv_lora_rank",), "count"),
    Field(("qk_rope_head_dim",), "count"),
    Field(("qk_nope_head_dim",), "count"),
    Field(("v_head_dim",), "count"),
    Field(("sliding_window",), "count"),
    Field(("max_window_layers",), "count0", noted=False),
    Field(("original_max_position_embeddings",), "count", noted=False),
    Field(("query_pre_attn_scalar",), "positive"),
    Field(("final_logit_softcapping",), "positive"),
    Field(("attn_logit_softcapping",), "positive"),
    Field(("rope_theta",), "positive"),
    Field(("tie_word_embeddings",), "bool"),
    Field(("attention_bias",), "bool", noted=False),
    Field(("mlp_bias",), "bool", noted=False),
    Field(("use_sliding_window",), "bool", noted=False),
    Field(("layer_types",), "names"),
    Field(("architectures",), "names"),
    Field(("_name_or_path",), "name"),
    Field(("mlp_only_layers",), "layers"),
    Field(("rope_scaling",), "rope"),
    Field(("rope_parameters",), "rope"),
)
BY_NAME = {f.name: f for f in FIELDS}
#: model_types whose every left-out field, given the core ones, is computed from the fields
#: given, not a fixed default of the class, once these are present too: their estimate needs
#: no ``transformers`` import (tests/test_hf_config_check.py checks this against the classes).
FIXED_DEFAULTS = {"llama": (), "gpt2": (), "mistral": ("num_key_value_heads", "sliding_window"),
                  "qwen2": ("num_key_value_heads", "sliding_window")}
ALLOWED = {"count": f"an integer 1-{MAX_COUNT}", "count0": f"an integer 0-{MAX_COUNT}",
           "bool": "true or false", "positive": "a finite number > 0", "name": "a string",
           "names": "a list of strings", "layers": "a list of layer indices",
           "rope": "an object (rope type, factor, original_max_position_embeddings) or null"}


@dataclass
class CheckedConfig:
    """A checked ``config.json``.

    Attributes:
        config: the config, with the class's fixed defaults of left-out fields written in.
        defaulted: field -> value for each size (and the tied head) that the file leaves
            to a fixed default of ``transformers``' class (empty when it was not asked).
        class_name: the transformers config class that supplied them (``LlamaConfig``), or "".
    """
    config: dict
    defaulted: dict = field(default_factory=dict)
    class_name: str = ""

    @property
    def note(self) -> str | None:
        """One line naming the defaulted fields and their values, or None."""
        if not self.defaulted:
            return None
        fields = ", ".join(f"{k}={v}" for k, v in self.defaulted.items())
        return (f"left to transformers' defaults ({self.class_name}), not in the config.json: "
                f"{fields}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _refuse(key: str, value, allowed: str) -> InputError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return InputError(f"config.json field {key}={shown}; allowed: {allowed}")


def _check_value(key: str, value, kind: str) -> None:  # noqa: C901 one branch per kind of config value
    """Refuse ``value`` unless it is what a field of ``kind`` holds (null is checked before)."""
    if kind in ("count", "count0"):
        low = 1 if kind == "count" else 0
        if not (_is_int(value) and low <= value <= MAX_COUNT):
            raise _refuse(key, value, ALLOWED[kind])
    elif kind == "bool":
        if not isinstance(value, bool):
            raise _refuse(key, value, ALLOWED[kind])
    elif kind == "positive":
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and value > 0):
            raise _refuse(key, value, ALLOWED[kind])
    elif kind == "name":
        if not isinstance(value, str):
            raise _refuse(key, value, ALLOWED[kind])
    elif kind == "names":
        if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise _refuse(key, value, "a non-empty list of strings")
    elif kind == "layers":
        if not (isinstance(value, list) and all(_is_int(v) and 0 <= v <= MAX_COUNT for v in value)):
            raise _refuse(key, value, ALLOWED[kind])
    elif kind == "rope":
        if not isinstance(value, dict):
            raise _refuse(key, value, ALLOWED[kind])
        for sub, sub_kind in (("factor", "positive"), ("rope_theta", "positive"),
                              ("original_max_position_embeddings", "count")):
            if value.get(sub) is not None:
                _check_value(f"{key}.{sub}", value[sub], sub_kind)
        for sub in ("rope_type", "type"):
            if value.get(sub) is not None and not isinstance(value[sub], str):
                raise _refuse(f"{key}.{sub}", value[sub], "a rope type name such as 'linear' or 'yarn'")


def model_type(cfg: dict) -> str:
    """The config's ``model_type``: a name (letters, digits, ``_``, ``-``, ``.``), never code."""
    kind = cfg.get("model_type")
    if not (isinstance(kind, str) and MODEL_TYPE.match(kind)):
        raise _refuse("model_type", kind, "a transformers model type name such as llama, qwen3, "
                                          "mixtral or gpt2 (letters, digits, '_', '-')")
    return kind


def given_fields(cfg: dict) -> dict:
    """Canonical field name -> value for each field of :data:`FIELDS` the config sets (not
    null), each value checked; two spellings of one field must agree.

    A dict because it is fields of a Hugging Face ``config.json``, by their canonical names.
    """
    given = {}
    for f in FIELDS:
        spelled = [(k, cfg[k]) for k in f.names if cfg.get(k) is not None]
        for k, v in spelled:
            _check_value(k, v, f.kind)
        if len({repr(v) for _, v in spelled}) > 1:
            raise InputError(f"config.json sets {' and '.join(f'{k}={v!r}' for k, v in spelled)}: "
                             f"these spell one field; allowed: one value")
        if spelled:
            given[f.name] = spelled[0][1]
    return given


def _divisors(n: int) -> str:
    if n > 10**6:
        return f"a divisor of {n}"
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    ds = sorted({*small, *(n // d for d in small)})
    shown = ", ".join(map(str, ds[:12])) + (", ..." if len(ds) > 12 else "")
    return f"a divisor of {n} ({shown})"


def check_relations(eff: dict, given: dict) -> None:
    """Refuse fields that disagree with each other. ``eff``: canonical name -> the value the
    model will have (given, else the class's default); ``given``: what the file sets."""
    d, heads, layers = eff.get("hidden_size"), eff.get("num_attention_heads"), eff.get("num_hidden_layers")
    if d and heads and eff.get("head_dim") is None and d % heads:
        raise InputError(f"config.json field num_attention_heads={heads} does not divide "
                         f"hidden_size={d}; allowed: {_divisors(d)}, or an explicit head_dim")
    kv = eff.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise InputError(f"config.json field num_key_value_heads={kv} does not divide "
                         f"num_attention_heads={heads}; allowed: {_divisors(heads)}")
    experts, top_k = eff.get("num_experts"), eff.get("num_experts_per_tok")
    if experts and top_k and top_k > experts and ("num_experts" in given or "num_experts_per_tok" in given):
        raise InputError(f"config.json field num_experts_per_tok={top_k} exceeds the {experts} "
                         f"experts; allowed: 1-{experts}")
    groups, top_groups = eff.get("n_group"), eff.get("topk_group")
    if experts and groups and experts % groups and ("n_group" in given or "num_experts" in given):
        raise InputError(f"config.json field n_group={groups} does not divide the {experts} "
                         f"routed experts; allowed: {_divisors(experts)}")
    if groups and top_groups and top_groups > groups and ("n_group" in given or "topk_group" in given):
        raise InputError(f"config.json field topk_group={top_groups} exceeds n_group={groups}; "
                         f"allowed: 1-{groups}")
    if layers:
        dense = eff.get("first_k_dense_replace")
        if dense is not None and dense > layers and "first_k_dense_replace" in given:
            raise InputError(f"config.json field first_k_dense_replace={dense} exceeds the "
                             f"{layers} layers; allowed: 0-{layers}")
        types = given.get("layer_types")
        if types is not None and len(types) != layers:
            raise InputError(f"config.json field layer_types has {len(types)} entries for "
                             f"num_hidden_layers={layers}; allowed: one per layer")
        bad = [i for i in given.get("mlp_only_layers") or () if i >= layers]
        if bad:
            raise InputError(f"config.json field mlp_only_layers names layer {bad[0]}; allowed: "
                             f"0-{layers - 1}")


def _config_class(kind: str):
    """transformers' config class of ``kind``, or None where transformers is not installed."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return None
    try:
        return CONFIG_MAPPING[kind]
    except KeyError:
        known = ", ".join(sorted(k for k in CONFIG_MAPPING.keys() if k.startswith(kind[:2].lower()))[:12])
        raise InputError(f"model_type {kind!r} is unknown to transformers; allowed: a model type "
                         f"of transformers' CONFIG_MAPPING"
                         + (f" (those starting {kind[:2].lower()!r}: {known})" if known else "")) from None


def _class_defaults(cls) -> dict:
    """The class's own defaults, by field name (computed ones are None here)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = None
    return out


def _class_spelling(f: Field, cls, defaults: dict) -> str | None:
    """The name of the field of ``cls`` that ``f`` is (through the class's ``attribute_map``
    aliases: GPT-2's ``hidden_size`` is ``n_embd``), or None where the class has none."""
    aliases = getattr(cls, "attribute_map", {}) or {}
    for name in f.names:
        if name in defaults:
            return name
        if aliases.get(name) in defaults:
            return aliases[name]
    return None


def _needs_class(kind: str, given: dict) -> bool:
    """Whether the file's left-out fields need transformers' class to be known (see
    :data:`FIXED_DEFAULTS`)."""
    if kind not in FIXED_DEFAULTS:
        return True
    need = [f.name for f in FIELDS if f.core] + list(FIXED_DEFAULTS[kind])
    if kind != "gpt2":  # GPT-2's n_inner left out is 4 x n_embd, computed
        need.append("intermediate_size")
    return any(n not in given for n in need)


def check_config(cfg: dict, *, construct: bool | None = None) -> CheckedConfig:
    """Check every field memlab reads (:data:`FIELDS`) before anything is built.

    Args:
        cfg: a ``config.json`` as a dict (with its ``model_type``).
        construct: build ``transformers``' config from it too, turning any refusal of
            transformers' own checks into an InputError (True: the simulation will build it);
            None: only when a left-out field needs the class's default (``transformers`` is
            then imported, where installed); False: never.

    Returns:
        A :class:`CheckedConfig`: the config with the class's fixed defaults written in, and
        the defaulted fields. Raises :class:`InputError` naming a bad field, its value and
        what is allowed.
    """
    if not isinstance(cfg, dict):
        raise InputError(f"config {type(cfg).__name__} is not a JSON object; allowed: a Hugging "
                         f"Face config.json (an object with a model_type)")
    kind = model_type(cfg)
    given = given_fields(cfg)
    use_class = construct if construct is not None else _needs_class(kind, given)
    if not use_class:
        check_relations(dict(given), given)
        return CheckedConfig(config=dict(cfg))
    kw = recorded("check", {"config": cfg, "construct": construct},
                  lambda: dataclasses.asdict(_check_with_class(kind, cfg, given)))
    return CheckedConfig(**kw)


def _check_with_class(kind: str, cfg: dict, given: dict) -> CheckedConfig:
    """:func:`check_config` with transformers' class of ``kind`` (where installed)."""
    cls = _config_class(kind)
    defaults = _class_defaults(cls) if cls is not None else {}
    eff, spelled = dict(given), {}
    for f in FIELDS:
        name = _class_spelling(f, cls, defaults) if cls is not None else None
        if name is not None:
            spelled[f.name] = name
            if f.name not in eff and defaults.get(name) is not None:
                eff[f.name] = defaults[name]
    check_relations(eff, given)
    if cls is None:
        return CheckedConfig(config=dict(cfg))
    conf = _construct(kind, cfg, cls)
    defaulted, filled = {}, dict(cfg)
    for f in FIELDS:
        name = spelled.get(f.name)
        if f.name in given or name is None or f.kind in ("names", "layers", "rope", "name"):
            continue
        value = getattr(conf, name, None)
        if value is None or value != defaults.get(name):
            continue  # computed from the fields given (Llama's num_key_value_heads = heads)
        filled[name] = value  # a fixed default of the class: the estimate reads it too
        if f.noted:
            defaulted[name] = value
    return CheckedConfig(config=filled, defaulted=defaulted, class_name=cls.__name__)


#: transformers' answers about the shipped configs, recorded (module doc)
RECORDED = ("data", "hf_resolved.json")
_LIVE = False  # True inside live_transformers(): every answer asked of transformers itself
_RECORDING: dict | None = None  # the answers being recorded (record())


def _key(what: str, inp: Any) -> str:
    text = json.dumps(inp, sort_keys=True, default=repr)
    return f"{what}:{hashlib.sha256(text.encode()).hexdigest()[:24]}"


def _transformers_version() -> str | None:
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def _recorded_table() -> dict:
    """The recorded answers, or {} when they were written under another transformers."""
    try:
        table = json.loads(resources.files("memlab").joinpath(*RECORDED).read_text())
    except FileNotFoundError:
        return {}
    version = _transformers_version()
    return table["answers"] if version is not None and table.get("transformers") == version else {}


def recorded(what: str, inp: Any, compute: Callable[[], Any]) -> Any:
    """transformers' answer about ``inp`` (``what`` names the question): the recorded one
    when this transformers wrote it for exactly this input, else ``compute()`` (which asks
    transformers, and must return JSON: lists, dicts, numbers, strings).

    Args:
        what: the question (``"check"``, ``"shape"``).
        inp: its input, JSON (the config dict and options).
        compute: the answer from transformers itself.

    Returns:
        The answer, as JSON (recorded) or as ``compute`` returns it.
    """
    key = _key(what, inp)
    if not _LIVE:
        hit = _recorded_table().get(key)
        if hit is not None:
            return hit
    value = compute()
    if _RECORDING is not None:
        _RECORDING[key] = json.loads(json.dumps(value))
    return value


@contextlib.contextmanager
def live_transformers() -> Iterator[None]:
    """While open, every answer comes from transformers itself, none from the record."""
    global _LIVE
    before, _LIVE = _LIVE, True
    try:
        yield
    finally:
        _LIVE = before


def record(run: Callable[[], None]) -> dict:
    """The table of transformers' answers asked while ``run()`` runs (under
    :func:`live_transformers`), as ``memlab/data/hf_resolved.json`` holds it.

    Args:
        run: the calls whose answers to record (tools/record_hf.py: the shipped configs).

    Returns:
        ``{"transformers": version, "answers": {key: answer}}``.

    A dict because it is ``memlab/data/hf_resolved.json``'s format, which it is written to.
    """
    global _RECORDING
    _RECORDING = {}
    try:
        with live_transformers():
            run()
        answers = dict(sorted(_RECORDING.items()))
    finally:
        _RECORDING = None
    return {"transformers": _transformers_version(), "answers": answers}


def _construct(kind: str, cfg: dict, cls):
    """transformers' config object of ``cfg``; its own refusals become an InputError."""
    kwargs = {k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version")}
    try:
        return cls(**kwargs)
    except Exception as e:  # transformers' checks raise ValueError, TypeError, strict dataclass errors
        text = " ".join(str(e).split()) or type(e).__name__
        if len(text) > 300:
            text = text[:297] + "..."
        raise InputError(f"transformers' {cls.__name__} refuses this config.json ({text}); allowed: "
                         f"the fields and values {cls.__name__} accepts") from None


__all__ = ["MAX_COUNT", "MODEL_TYPE", "Field", "FIELDS", "BY_NAME", "FIXED_DEFAULTS", "CheckedConfig",
           "model_type", "given_fields", "check_relations", "check_config", "recorded", "live_transformers",
           "record", "RECORDED"]
