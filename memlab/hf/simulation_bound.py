"""A bound before a long simulation of a Hugging Face config, and its progress bar.

The fake-tensor simulation costs time per operator, not per byte: each decoder layer adds a
few hundred operators to the forward and backward, each dispatched through the fake mode and
memlab's tracker, so its wall time grows with the layers (and a little with the tokens), not
with the width. A config with an extra zero or two (100,000 layers) runs for hours with no
output, while the estimate answers in a second. :func:`simulation_bound` predicts the
simulation's time before it starts, with the estimate's peak where the estimate covers the
model; :func:`check_bound` refuses a step past :data:`MAX_SECONDS` or :data:`PARAM_LIMIT`,
naming the figure and the flag that goes on anyway (``--allow-long``); a step whose bytes
exceed what the fake tensors' 64-bit sizes can count (:data:`BYTES_LIMIT`) is refused always.
:func:`progress` shows a bar over the decoder layers' forward and backward.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import Iterator

import torch
from tqdm import tqdm

from memlab.core.cards import CARDS
from memlab.core.errors import InputError
from memlab.core.units import fmt_bytes
from memlab.hf.config import load_config
from memlab.hf.config_check import expert_count
from memlab.hf.shape import decoder_shape
from memlab.lenses.decoder_estimate import estimate_run
from memlab.step.training_step import StepConfig

#: Seconds of a simulation, measured on the development machine (2 shared cores, fp32 Llama
#: configs on fake tensors, target cuda, batch 1): 2 layers 3.9 s, 4 layers 5.2 s and 16
#: layers 12.9 s at 64 tokens (0.64 s a layer); 4 layers at 8,192 tokens 0.5 s more than at
#: 64 (1.5e-5 s a layer and token); the width (256 or 1,000,000) changed it by under 1 s.
SECONDS_BASE = 2.7
SECONDS_PER_LAYER = 0.64
SECONDS_PER_LAYER_TOKEN = 1.5e-5
#: A simulation predicted past this many seconds is refused unless --allow-long.
MAX_SECONDS = 300.0
#: Parameters past which a simulation is refused unless --allow-long: 100 trillion, fifty
#: times the largest published models (about 2 trillion); such a config is a typo far more
#: often than a plan, and its estimate already says what it holds.
PARAM_LIMIT = 10**14
#: Bytes the simulation can count: torch's sizes are 64-bit (2^63 - 1), 2^62 leaves headroom.
BYTES_LIMIT = 2**62
#: A bar is shown on a terminal for a simulation predicted past this many seconds.
PROGRESS_AFTER = 10.0
ALLOW_FLAG = "--allow-long"


@dataclass
class SimulationBound:
    """What a simulation of one step would cost, known before it starts.

    Attributes:
        layers: decoder layers of the model.
        tokens: tokens of the step (batch x seq).
        seconds: the predicted wall time of the simulation (the constants above).
        params: parameters (the estimate's count, else counted from the config's sizes).
        estimate_bytes: the estimate's peak bytes, or None where the estimate does not cover
            the model_type.
    """
    layers: int
    tokens: int
    seconds: float
    params: int
    estimate_bytes: int | None

    def figure(self) -> str:
        """The estimate's peak, with "more than any card" where it is."""
        if self.estimate_bytes is None:
            return f"{self.params:,} parameters ({fmt_bytes(16 * self.params)} of fp32 weights, gradients and AdamW)"
        return f"the estimate's peak {fmt_bytes(self.estimate_bytes)}{beyond_cards(self.estimate_bytes)}"

    def refusal(self) -> str | None:
        """Why a simulation is refused unless --allow-long, or None."""
        if self.seconds > MAX_SECONDS:
            return (f"the simulation would run about {self.seconds:,.0f} s ({self.layers:,} layers x "
                    f"{SECONDS_PER_LAYER} s + {self.tokens:,} tokens x {self.layers:,} layers x "
                    f"{SECONDS_PER_LAYER_TOKEN} s, measured on fake tensors), past the bound of "
                    f"{MAX_SECONDS:.0f} s")
        if self.params > PARAM_LIMIT:
            return f"{self.params:,} parameters exceed the simulation's limit of {PARAM_LIMIT:,}"
        return None


def beyond_cards(nbytes: float) -> str:
    """``" (more than any card: the largest, H200-141GB, holds 141.00 GiB)"`` when
    ``nbytes`` exceeds every card memlab knows, else ``""``."""
    largest = max(CARDS.values(), key=lambda c: c.memory)
    if nbytes <= largest.memory:
        return ""
    return f" (more than any card: the largest, {largest.name}, holds {fmt_bytes(largest.memory)})"


def rough_params(cfg: dict) -> int:
    """Parameters from a config's sizes: embeddings and head, attention and MLP (each
    expert's, where it routes) per layer; norms and biases left out (under 0.1%)."""
    d = cfg.get("hidden_size") or cfg.get("n_embd") or 0
    layers = cfg.get("num_hidden_layers") or cfg.get("n_layer") or 0
    heads = cfg.get("num_attention_heads") or cfg.get("n_head") or 1
    head_dim = cfg.get("head_dim") or max(d // heads, 1)
    kv = cfg.get("num_key_value_heads") or heads
    ff = cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * d
    experts = expert_count(cfg)
    mlp = 3 * d * ff if not experts else 3 * d * (cfg.get("moe_intermediate_size") or ff) * experts
    attention = 2 * d * heads * head_dim + 2 * d * kv * head_dim
    vocab = cfg.get("vocab_size") or 0
    return vocab * d * (1 if cfg.get("tie_word_embeddings") else 2) + layers * (attention + mlp)


def simulation_bound(cfg, *, seq: int, batch: int, precision: str = "fp32",
                     checkpointing: str | None = None, attention: str | None = None,
                     target: str = "cuda") -> SimulationBound:
    """The cost of simulating one step of the HF config ``cfg`` (see the module doc).

    Args:
        cfg: a config.json path, shipped name or dict (:func:`memlab.hf.config.load_config`).
        seq, batch, precision, checkpointing, attention, target: the step, as for
            :func:`memlab.hf.simulate.simulate_hf`.

    Returns:
        A :class:`SimulationBound`.
    """
    d = load_config(cfg)
    layers = int(d.get("num_hidden_layers") or d.get("n_layer") or 1)
    tokens = seq * batch
    seconds = SECONDS_BASE + layers * (SECONDS_PER_LAYER + tokens * SECONDS_PER_LAYER_TOKEN)
    estimate_bytes, params = None, rough_params(d)
    try:
        step = StepConfig(decoder_shape(d), seq=seq, batch=batch, precision=precision,
                          checkpointing=checkpointing, attention=attention)
        # the decoder's count itself, not estimate_step: the CLI imports this module at startup, and
        # estimate_step's time lens would slow every command (tests/test_startup.py)
        estimate_bytes = estimate_run(step, target=target).peak_bytes
        params = step.model_config.num_params()
    except InputError:
        pass  # the estimate does not cover this model_type: the sizes' count stands
    return SimulationBound(layers=layers, tokens=tokens, seconds=seconds, params=params,
                           estimate_bytes=estimate_bytes)


def check_bound(bound: SimulationBound, *, allow_long: bool = False) -> None:
    """Refuse a simulation the bound says is too long or too large (:class:`InputError`).

    Args:
        bound: from :func:`simulation_bound`.
        allow_long: go on past :data:`MAX_SECONDS` and :data:`PARAM_LIMIT` (never past
            :data:`BYTES_LIMIT`, which the fake tensors cannot count).
    """
    peak = bound.estimate_bytes if bound.estimate_bytes is not None else 16 * bound.params
    if peak >= BYTES_LIMIT:
        raise InputError(f"simulate: {bound.figure()} exceeds the {fmt_bytes(BYTES_LIMIT)} that "
                         f"fake tensors' 64-bit sizes can count; allowed: a smaller model, sequence "
                         f"or batch (`memlab estimate` with the same flags gives the figure)")
    why = bound.refusal()
    if why is not None and not allow_long:
        raise InputError(f"simulate: {why}; {bound.figure()}. Run `memlab estimate` with the same "
                         f"flags for the figure in a second, or pass {ALLOW_FLAG} to simulate anyway")


def wants_progress(bound: SimulationBound, asked: bool, stream=None) -> bool:
    """A bar when asked, or on a terminal (never under pytest or nbval, whose streams are
    not terminals) for a simulation predicted past :data:`PROGRESS_AFTER` seconds."""
    stream = sys.stderr if stream is None else stream
    is_tty = bool(getattr(stream, "isatty", lambda: False)())
    return asked or (is_tty and bound.seconds > PROGRESS_AFTER)


def _is_decoder_layer(module: torch.nn.Module) -> bool:
    # transformers' decoder layers: LlamaDecoderLayer, Qwen3MoeDecoderLayer, GPT2Block, ...
    return type(module).__name__.endswith(("DecoderLayer", "Block"))


@contextlib.contextmanager
def progress(layers: int, enabled: bool = True, stream=None) -> Iterator[object | None]:
    """While open, a ``tqdm`` bar on ``stream`` (stderr) counts the decoder layers' forward
    and then their backward (2 x ``layers`` steps), through a module forward hook that puts a
    gradient hook on each layer's output. Yields the bar, or None when not ``enabled``."""
    if not enabled:
        yield None
        return
    bar = tqdm(total=2 * layers, desc="simulate (layers forward, then backward)", unit="layer",
               file=sys.stderr if stream is None else stream, leave=False)
    seen = {"forward": 0, "backward": 0}

    def on_backward(grad):
        if seen["backward"] < layers:
            seen["backward"] += 1
            bar.update(1)

    def on_forward(module, args, output):
        if not _is_decoder_layer(module):
            return None
        if seen["forward"] < layers:  # a checkpointed layer's recomputation is not counted
            seen["forward"] += 1
            bar.update(1)
        out = output[0] if isinstance(output, (tuple, list)) and output else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(on_backward)
        return None

    handle = torch.nn.modules.module.register_module_forward_hook(on_forward)
    try:
        yield bar
    finally:
        handle.remove()
        bar.close()


__all__ = ["SECONDS_BASE", "SECONDS_PER_LAYER", "SECONDS_PER_LAYER_TOKEN", "MAX_SECONDS", "PARAM_LIMIT",
           "BYTES_LIMIT", "PROGRESS_AFTER", "ALLOW_FLAG", "SimulationBound", "beyond_cards", "rough_params",
           "simulation_bound", "check_bound", "wants_progress", "progress"]
