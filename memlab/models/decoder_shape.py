"""The one description of a decoder's shape that the lenses read: :class:`DecoderShape`.

Widths, heads and head dims, norms, biases, fused projections, tied head, dropout, sliding
windows and softcaps, multi-head latent attention (DeepSeek) and mixtures of experts (routed
and shared experts, top-k, the dense first layers, the router), with the parameter counts and
tensors of the class built from it. A Hugging Face config produces one
(:func:`memlab.hf.shape.decoder_shape`), and so does memlab's own GPT
(:attr:`memlab.models.gpt_unet.GPTConfig.shape`, ``model_type`` :data:`MEMLAB_GPT`): one parameter
count and one list of parameter tensors for every decoder memlab reads. The estimate
(:mod:`memlab.lenses.decoder_estimate`), the model states (:mod:`memlab.step.decoder_states`) and a
run (:class:`memlab.step.training_step.StepConfig` with a ``DecoderShape`` as its model) read it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from memlab.core.errors import InputError

#: the ``model_type`` of memlab's own GPT's shape (:attr:`memlab.models.gpt_unet.GPTConfig.shape`)
MEMLAB_GPT = "memlab-gpt"


@dataclass(frozen=True)
class DecoderShape:
    """What a decoder's memory depends on, read from its config (see the module doc)."""

    model_type: str
    name: str
    n_layer: int
    d: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int           # q/k head dim (MLA: nope + rope)
    v_head_dim: int
    ffn: int                # the dense MLP's hidden size
    tied: bool
    norm: str = "rms"       # "rms" (Llama-style), "gemma" (x * (1 + w) in fp32) or "layer"
    norm_bias: bool = True  # a LayerNorm's bias (memlab's GPT without biases has none)
    norms_per_layer: int = 2
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False  # gate and up in one Linear (Phi-3)
    mlp: str = "gated"      # "gated", "gelu_new" (GPT-2's, biased) or "gelu" (memlab's GPT: biases as mlp_bias)
    mlp_bias: bool = False
    positions: int = 0      # learned position rows (GPT-2)
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    embd_dropout: float = 0.0
    attn_softcap: float | None = None
    final_softcap: float | None = None
    window: int | None = None            # the sliding window's width, on the layers in sliding_layers
    sliding_layers: tuple[int, ...] = ()
    sinks: bool = False
    eager_only: bool = False  # the class has no SDPA path
    # multi-head latent attention (DeepSeek)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_dim: int = 0
    # mixture of experts
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0     # shared experts' total hidden size (DeepSeek: n_shared * moe_ffn)
    moe_layers: tuple[int, ...] = ()
    router: str = "softmax"  # "softmax", "sigmoid_group" (DeepSeek) or "topk_softmax" (gpt-oss)
    router_groups: int = 1
    router_topk_groups: int = 1
    expert_bias: bool = False
    gate: str = "glu"       # "glu" (act(gate) * up) or "clamped_glu" (gpt-oss)
    context: int | None = None  # the longest sequence the config allows (None: not bounded)
    use_cache: bool = True  # the config's use_cache: a training forward builds a DynamicCache

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def attention_params(self) -> int:
        """Weights of one layer's attention (projections, biases, q/k norms, sinks)."""
        d, q, kv = self.d, self.q_dim, self.kv_dim
        if self.q_lora_rank is not None or self.kv_lora_rank is not None:
            ql, kl, rope = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_dim
            nope = self.head_dim - rope
            qp = d * q if ql is None else d * ql + ql + ql * q   # q_a_proj, its norm, q_b_proj
            return (qp + d * (kl + rope) + kl + kl * self.heads * (nope + self.v_head_dim)
                    + self.heads * self.v_head_dim * d)
        n = d * (q + 2 * kv) + q * d
        n += (q + 2 * kv) * self.qkv_bias + d * self.o_bias
        n += 2 * self.head_dim * self.qk_norm + self.heads * self.sinks
        return n

    def dense_mlp_params(self, ffn: int | None = None) -> int:
        return sum(self._dense_mlp(self.ffn if ffn is None else ffn))

    def _dense_mlp(self, f: int) -> list[int]:
        """A dense MLP's parameter tensors: its matrices, then its biases."""
        d = self.d
        if self.mlp in ("gelu_new", "gelu"):
            return [d * f, f * d] + ([f, d] if self.mlp == "gelu_new" or self.mlp_bias else [])
        return ([2 * d * f, f * d] if self.fused_gate_up else [d * f, d * f, f * d]) + (
            [f, f, d] if self.mlp_bias else [])

    def expert_params(self) -> int:
        """All routed experts of one MoE layer (gate_up and down, and their biases)."""
        f, d = self.moe_ffn, self.d
        return self.experts * (3 * d * f + (2 * f + d) * self.expert_bias)

    def router_params(self) -> int:
        bias = self.experts if self.router == "topk_softmax" else 0  # DeepSeek's score bias is a buffer
        return self.experts * self.d + bias

    def _norm(self) -> list[int]:
        """One norm's parameter tensors (a LayerNorm's weight and bias, or a weight)."""
        return [self.d, self.d] if self.norm == "layer" and self.norm_bias else [self.d]

    def layer_params(self, i: int) -> int:
        norms = self.norms_per_layer * sum(self._norm())
        if i in self.moe_layers:
            mlp = self.router_params() + self.expert_params() + (
                self.dense_mlp_params(self.shared_ffn) if self.shared_ffn else 0)
        else:
            mlp = self.dense_mlp_params()
        return self.attention_params() + mlp + norms

    def num_params(self) -> int:
        """Parameters of the ``...ForCausalLM`` class built from the config."""
        embed = self.vocab * self.d + self.positions * self.d
        head = 0 if self.tied else self.vocab * self.d
        return embed + head + sum(self._norm()) + sum(self.layer_params(i) for i in range(self.n_layer))

    def active_params(self, embedding: bool = True) -> int:
        """Parameters one token's forward uses: the routed experts' ``top_k / experts`` share.
        Model cards differ on the input embedding (a lookup, not a matmul): Qwen and DeepSeek
        count it, gpt-oss's card does not (``embedding=False``); the output head counts always."""
        idle = sum(self.expert_params() * (1 - self.top_k / self.experts) for _ in self.moe_layers)
        lookup = 0 if embedding or self.tied else self.vocab * self.d
        return int(round(self.num_params() - idle - lookup))

    def param_numels(self) -> list[int]:
        """Elements of each parameter tensor of the ``...ForCausalLM`` class (memlab's GPT for a
        :data:`MEMLAB_GPT` shape), in closed form: the one parameter count memlab has, and
        what DeepSpeed's buffers depend on (the largest tensor, the small ones ZeRO-3 keeps
        whole on every rank). ``transformers`` 5 stores each MoE layer's routed experts as
        two 3-d tensors (``gate_up_proj``, ``down_proj``) and fuses Phi-3's q/k/v and gate/up;
        the sum is :meth:`num_params`."""
        d, q, kv, hd = self.d, self.q_dim, self.kv_dim, self.head_dim
        norm = self._norm()
        out = [self.vocab * d] + ([self.positions * d] if self.positions else [])
        for i in range(self.n_layer):
            out += norm * self.norms_per_layer
            if self.q_lora_rank is not None or self.kv_lora_rank is not None:
                ql, kl, rope = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_dim
                out += [d * q] if ql is None else [d * ql, ql, ql * q]
                out += [d * (kl + rope), kl, kl * self.heads * (hd - rope + self.v_head_dim),
                        self.heads * self.v_head_dim * d]
            else:
                out += [d * (q + 2 * kv)] if self.fused_qkv else [d * q, d * kv, d * kv]
                out += ([q + 2 * kv] if self.fused_qkv else [q, kv, kv]) if self.qkv_bias else []
                out += [q * d] + ([d] if self.o_bias else [])
                out += [hd, hd] if self.qk_norm else []
                out += [self.heads] if self.sinks else []
            if i in self.moe_layers:
                e, f = self.experts, self.moe_ffn
                out += [e * d] + ([e] if self.router == "topk_softmax" else [])
                out += [e * 2 * f * d, e * d * f] + ([e * 2 * f, e * d] if self.expert_bias else [])
                out += [d * self.shared_ffn] * 3 if self.shared_ffn else []
            else:
                out += self._dense_mlp(self.ffn)
        return out + norm + ([] if self.tied else [self.vocab * d])

    def linears(self, i: int) -> dict[str, list[tuple[int, int]]]:
        """``(in_features, out_features)`` of every ``nn.Linear`` of layer ``i``, by the module
        name peft's ``target_modules`` matches (GPT-2's ``c_proj`` names two). Routed experts
        (3-d parameters in transformers 5) and routers are not ``Linear`` modules."""
        d, q, kv, a, vd = self.d, self.q_dim, self.kv_dim, self.heads, self.v_head_dim
        if self.model_type == MEMLAB_GPT:  # memlab.models.gpt_unet's module names
            mlp = {"fc": [(d, self.ffn)], "out": [(self.ffn, d)]}
            return {"qkv": [(d, q + 2 * kv)], "proj": [(q, d)], **mlp,
                    **({"gate": [(d, self.ffn)]} if self.mlp == "gated" else {})}
        if self.mlp == "gelu_new":
            return {"c_attn": [(d, 3 * d)], "c_proj": [(d, d), (self.ffn, d)], "c_fc": [(d, self.ffn)]}
        if self.kv_lora_rank is not None:
            ql, kl, rope = self.q_lora_rank, self.kv_lora_rank, self.qk_rope_dim
            out = ({"q_proj": [(d, q)]} if ql is None else {"q_a_proj": [(d, ql)], "q_b_proj": [(ql, q)]})
            out.update(kv_a_proj_with_mqa=[(d, kl + rope)], kv_b_proj=[(kl, a * (self.head_dim - rope + vd))])
        elif self.fused_qkv:
            out = {"qkv_proj": [(d, q + 2 * kv)]}
        else:
            out = {"q_proj": [(d, q)], "k_proj": [(d, kv)], "v_proj": [(d, kv)]}
        out["o_proj"] = [(a * vd, d)]
        f = self.shared_ffn if i in self.moe_layers else self.ffn
        if i in self.moe_layers and not f:
            return out
        if self.fused_gate_up:
            out.update(gate_up_proj=[(d, 2 * f)], down_proj=[(f, d)])
        else:
            out.update(gate_proj=[(d, f)], up_proj=[(d, f)], down_proj=[(f, d)])
        return out

    def linear_names(self) -> tuple[str, ...]:
        """Every layer's ``Linear`` module names (:meth:`linears`), in order, each once: what
        peft's ``all-linear`` adapts on a decoder."""
        return tuple(dict.fromkeys(k for i in range(self.n_layer) for k in self.linears(i)))

    def check_tensor_parallel(self, tensor_parallel: int) -> None:
        """Refuse a tensor-parallel degree Megatron-LM's layout cannot split this decoder by:
        it must divide the query and key/value heads and every MLP width (dense, routed experts',
        shared experts'). (memlab's GPT also replicates key/value heads past their number;
        for a decoder's shape that layout is not counted.)"""
        t = tensor_parallel
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise InputError(f"tensor-parallel degree must be a positive integer, got {t!r}")
        widths = [w for w in (self.heads, self.kv_heads, self.ffn, self.moe_ffn, self.shared_ffn) if w]
        allowed = [k for k in range(1, self.heads + 1) if all(w % k == 0 for w in widths)]
        if t not in allowed:
            raise InputError(f"tensor-parallel degree t={t} must divide the {self.heads} query heads, the "
                             f"{self.kv_heads} key/value heads and the MLP widths; allowed: "
                             f"{', '.join(map(str, allowed))}")

    def tensor_parallel_shard(self, tensor_parallel: int) -> "DecoderShape":
        """What one of ``t`` tensor-parallel ranks runs of each layer, as a shape (Megatron-LM,
        Shoeybi et al. 2019, sec. 3; Korthikanti et al. 2022, sec. 4.2.1 without sequence
        parallelism): the column-parallel q/k/v and gate/up projections and the row-parallel
        o/down ones leave it ``1/t`` of the query heads, of the key/value heads and of every MLP
        width, and the vocabulary-parallel head and loss ``1/t`` of the vocabulary (rounded up);
        the residual width, the norms and what they keep stay whole. Multi-head latent
        attention's compressed q and kv (``q_lora_rank``, ``kv_lora_rank``) stay whole too."""
        self.check_tensor_parallel(tensor_parallel)
        t = tensor_parallel
        if t == 1:
            return self
        return replace(self, heads=self.heads // t, kv_heads=self.kv_heads // t, ffn=self.ffn // t,
                       moe_ffn=self.moe_ffn // t, shared_ffn=self.shared_ffn // t, vocab=-(-self.vocab // t),
                       name=f"{self.name} (1/{t} tensor-parallel rank)")

    def expert_total(self) -> int:
        """Parameters of all routed experts (what expert parallelism divides)."""
        return len(self.moe_layers) * self.expert_params()


__all__ = ["MEMLAB_GPT", "DecoderShape"]
