"""litgpt's Llama with LoRA, as the code of its published resource tables ran it (memlab's own, small copy).

Lightning-AI/litgpt at commit ``8641822`` (the one ``tutorials/resource-tables.md`` names) and
``6178c7cc`` ("Half precision fixes", #606), the two :mod:`memlab.lenses.litgpt_estimate` counts;
``finetune/lora.py`` there under Lightning Fabric ``bf16-true`` (Lightning ``71aed751``). This
module is memlab's code, written to run the same ops in the same order, so that the simulation
(:func:`memlab.hf.simulate.simulate_hf` with ``implementation="litgpt-<commit>"``) keeps what
litgpt's step kept. For a Llama with one key/value head per query head (Llama 2 7B, 13B):

* :class:`RMSNorm`: ``lit_gpt/rmsnorm.py`` lines 17-21; at 6178c7cc the input is cast to fp32
  first (``x = x.float()``, line 19 there) and the result cast back.
* :class:`LoRAQKVLinear`: ``lit_gpt/lora.py`` (6178c7cc) lines 256-296 (``zero_pad``: a zero
  tensor, ``index_copy`` of the adapters' columns, with an int64 index made each call),
  298-331 (``conv1d`` grouped by adapted projection), 351-386 (``forward``: one dropout for
  every adapter, ``lora_A`` by ``F.linear``, ``lora_B`` by ``conv1d``).
* :class:`CausalSelfAttention`: ``lit_gpt/model.py`` (8641822) lines 185-231: q, k and v are
  views of the fused output; rope in the cache's dtype (fp32: ``finetune/lora.py`` sets
  ``model.max_seq_length`` outside Fabric's bf16 context, rebuilding the cache in the default
  fp32), ``type_as`` back, ``torch.cat``; SDPA, causal, no mask; its output, in q's layout (flash's
  ``mha_fwd`` allocates ``empty_like(q)``), transposed and reshaped: a copy, the projection's input.
* :class:`LLaMAMLP`: ``lit_gpt/model.py`` lines 294-305.
* :class:`LitGPT`: ``lit_gpt/lora.py`` lines 478-503: the head in chunks of ``lm_head_chunk_size``
  tokens, a list; :func:`fabric_forward` is Fabric's ``_FabricModule.forward`` (Lightning
  ``src/lightning/fabric/wrappers.py`` lines 116-124): the output list cast to the default dtype,
  fp32 (``plugins/precision/half.py`` line 52, ``bitsandbytes.py`` line 143).
* :func:`chunked_cross_entropy`: ``lit_gpt/utils.py`` lines 238-262, the per-chunk path.
* :func:`litgpt_step`: one iteration of ``finetune/lora.py``'s ``train`` (lines 212-224 at
  6178c7cc): ``logits[-1]`` sliced to drop the last token, the loss, backward, the optimizer step;
  ``logits`` and ``loss`` live on until the next iteration rebinds them.

Every weight is ``bf16`` (``bf16-true``; the adapters too), the frozen ones without gradients
(``mark_only_lora_as_trainable``). Only what memory depends on is here: no KV cache, no GQA, no
biases, no weight loading.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: litgpt's ``lm_head_chunk_size`` in ``finetune/lora.py`` (line 216 at 6178c7cc)
HEAD_CHUNK = 128


@dataclass(frozen=True)
class LitGPTConfig:
    """The fields of litgpt's ``Config`` (plus ``lit_gpt/lora.py``'s ``Config``) this model reads.

    ``fp32_norm``: 6178c7cc's RMSNorm (``x.float()``); 8641822's computes in its input's dtype.
    ``enable``: ``(to_query, to_key, to_value)``.
    """

    n_embd: int
    n_head: int
    n_layer: int
    intermediate_size: int
    vocab: int
    r: int = 8
    alpha: int = 16
    dropout: float = 0.05
    enable: tuple[bool, bool, bool] = (True, False, True)
    fp32_norm: bool = True
    norm_eps: float = 1e-5
    rope_base: int = 10000

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


class RMSNorm(nn.Module):
    """``lit_gpt/rmsnorm.py``: ``x * rsqrt(mean(x * x) + eps)`` times the weight, in fp32 at
    6178c7cc (``fp32``), in the input's dtype at 8641822."""

    def __init__(self, size: int, eps: float, fp32: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.fp32 = eps, fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if self.fp32:
            x = x.float()
        norm_x = torch.mean(x * x, dim=-1, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        out = self.weight * x_normed
        return out.to(dtype=dtype) if self.fp32 else out


class LoRAQKVLinear(nn.Module):
    """The fused q/k/v projection with LoRA on the enabled ones (``lit_gpt/lora.py``, see the module doc)."""

    def __init__(self, c: LitGPTConfig):
        super().__init__()
        d = c.n_embd
        self.linear = nn.Linear(d, 3 * d, bias=False)
        self.enable = c.enable
        self.dropout = nn.Dropout(c.dropout) if c.dropout > 0 else nn.Identity()
        n = sum(c.enable)
        self.lora_A = nn.Parameter(torch.zeros(c.r * n, d))
        self.lora_B = nn.Parameter(torch.zeros(d * n, c.r))   # MHA: each of q, k, v is d wide
        self.scaling = c.alpha / c.r
        self.lora_ind = [i for j, on in enumerate(c.enable) if on for i in range(j * d, (j + 1) * d)]
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def zero_pad(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' output scattered into the fused width (lines 256-296): ``index_copy``
        keeps its source (a reshaped copy of the transposed output) and its int64 index."""
        if all(self.enable):
            return x
        out = self.linear.out_features
        x = x.transpose(0, 1)
        result = x.new_zeros((*x.shape[:-1], out)).view(-1, out)
        result = result.index_copy(1, torch.tensor(self.lora_ind, device=result.device), x.reshape(-1, x.shape[-1]))
        return result.view((*x.shape[:-1], out)).transpose(0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pretrained = self.linear(x)
        after_a = F.linear(self.dropout(x), self.lora_A)
        # one group per adapted projection (MHA: ``n_head == n_query_groups``, lines 319-320)
        after_b = F.conv1d(after_a.transpose(-2, -1), self.lora_B.unsqueeze(-1),
                           groups=sum(self.enable)).transpose(-2, -1)
        return pretrained + self.zero_pad(after_b) * self.scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``lit_gpt/model.py`` ``apply_rope``: in the cache's dtype, ``type_as`` back to ``x``'s."""
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return ((x * cos) + (rotated * sin)).type_as(x)


class CausalSelfAttention(nn.Module):
    """Multi-head attention on the fused projection (``lit_gpt/model.py`` lines 185-231, MHA)."""

    def __init__(self, c: LitGPTConfig):
        super().__init__()
        self.attn = LoRAQKVLinear(c)
        self.proj = nn.Linear(c.n_embd, c.n_embd, bias=False)
        self.c = c

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        hs, nh = self.c.head_size, self.c.n_head
        qkv = self.attn(x).view(B, T, nh, 3, hs).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((1, 1, 1), dim=2)
        q, k, v = (t.reshape(B, -1, T, hs) for t in (q, k, v))   # views: one group per head
        q = torch.cat((apply_rope(q, cos, sin), q[..., hs:]), dim=-1)
        k = torch.cat((apply_rope(k, cos, sin), k[..., hs:]), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=1.0 / math.sqrt(hs), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class LLaMAMLP(nn.Module):
    """``silu(fc_1(x)) * fc_2(x)`` then ``proj`` (``lit_gpt/model.py`` lines 294-305)."""

    def __init__(self, c: LitGPTConfig):
        super().__init__()
        self.fc_1 = nn.Linear(c.n_embd, c.intermediate_size, bias=False)
        self.fc_2 = nn.Linear(c.n_embd, c.intermediate_size, bias=False)
        self.proj = nn.Linear(c.intermediate_size, c.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    """A pre-norm block, sequential residual (``lit_gpt/model.py``, 6178c7cc's operand order)."""

    def __init__(self, c: LitGPTConfig):
        super().__init__()
        self.norm_1 = RMSNorm(c.n_embd, c.norm_eps, c.fp32_norm)
        self.attn = CausalSelfAttention(c)
        self.norm_2 = RMSNorm(c.n_embd, c.norm_eps, c.fp32_norm)
        self.mlp = LLaMAMLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.norm_1(x), cos, sin) + x
        return self.mlp(self.norm_2(x)) + x


class LitGPT(nn.Module):
    """litgpt's LoRA ``GPT`` (``lit_gpt/lora.py``): embedding, blocks, final norm, the head in chunks."""

    def __init__(self, c: LitGPTConfig, seq: int):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = RMSNorm(c.n_embd, c.norm_eps, c.fp32_norm)
        self.lm_head = nn.Linear(c.n_embd, c.vocab, bias=False)
        # the rope cache for the longest sample, fp32 (``build_rope_cache``; see the module doc)
        theta = 1.0 / (c.rope_base ** (torch.arange(0, c.head_size, 2).float() / c.head_size))
        idx_theta = torch.outer(torch.arange(seq).float(), theta).repeat(1, 2)
        self.register_buffer("cos", torch.cos(idx_theta), persistent=False)
        self.register_buffer("sin", torch.sin(idx_theta), persistent=False)

    def forward(self, idx: torch.Tensor, lm_head_chunk_size: int = HEAD_CHUNK) -> list[torch.Tensor]:
        T = idx.size(1)
        cos, sin = self.cos[:T], self.sin[:T]
        x = self.wte(idx)
        for block in self.h:
            x = block(x, cos, sin)
        x = self.ln_f(x)
        return [self.lm_head(x_i) for x_i in x.split(lm_head_chunk_size, dim=1)]


def build_litgpt(c: LitGPTConfig, seq: int, dtype: torch.dtype = torch.bfloat16) -> LitGPT:
    """The model made with ``dtype`` the default (Fabric's ``init_module`` under ``bf16-true``:
    every weight, the adapters too; the rope cache stays fp32, as ``finetune/lora.py`` rebuilds
    it), only the adapters trainable (``mark_only_lora_as_trainable``)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = LitGPT(c, seq)
    finally:
        torch.set_default_dtype(default)
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name
    return model.train()


def fabric_forward(model: nn.Module, idx: torch.Tensor) -> list[torch.Tensor]:
    """Fabric's wrapped forward: the output (a list of chunks) cast to the default dtype, fp32."""
    return [chunk.to(torch.get_default_dtype()) for chunk in model(idx)]


def chunked_cross_entropy(logits: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """``lit_gpt/utils.py`` lines 255-262: one cross-entropy per chunk, ``reduction="none"``, the mean of all."""
    logit_chunks = [chunk.reshape(-1, chunk.size(-1)) for chunk in logits]
    target_chunks = [t.reshape(-1) for t in targets.split(logits[0].size(1), dim=1)]
    losses = [F.cross_entropy(lc, tc, ignore_index=-1, reduction="none")
              for lc, tc in zip(logit_chunks, target_chunks, strict=True)]
    return torch.cat(losses).mean()


def litgpt_step(seq: int, batch: int, vocab: int) -> Callable[[nn.Module, object], None]:
    """A ``step_fn(model, optimizer)`` for :func:`memlab.lenses.your_model.simulate_model`: one
    iteration of ``finetune/lora.py``'s loop on ``batch`` random sequences of ``seq`` tokens
    (``logits`` and ``loss`` held through the optimizer step, as the loop's variables are)."""

    def step(model: nn.Module, optimizer) -> None:
        device = next(model.parameters()).device
        input_ids = torch.randint(0, vocab, (batch, seq), device=device)
        targets = torch.randint(0, vocab, (batch, seq), device=device)
        logits = fabric_forward(model, input_ids)
        logits[-1] = logits[-1][..., :-1, :]          # output n predicts token n + 1
        loss = chunked_cross_entropy(logits, targets[..., 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        del logits, loss
    return step


__all__ = ["HEAD_CHUNK", "LitGPTConfig", "RMSNorm", "LoRAQKVLinear", "apply_rope", "CausalSelfAttention",
           "LLaMAMLP", "Block", "LitGPT", "build_litgpt", "fabric_forward", "chunked_cross_entropy",
           "litgpt_step"]
