"""The simulation of a whole Hugging Face run: the real class on fake tensors, as the run trains.

:func:`simulate_hf` takes the run arguments of :func:`memlab.hf.estimate.estimate_hf` (the same
keyword names, so one run description feeds both) and runs them on fake tensors
(:func:`memlab.lenses.your_model.simulate_model`):

* **accumulation** (``micro_batches``): the loop a learner writes (:func:`memlab.hf.config.causal_lm_step`), each
  loss divided by the micro-batches, the gradients accumulating in ``.grad``.
* **optimizers** (:data:`memlab.step.low_bit.OPTIMIZER_STATES`, :func:`make_optimizer`): torch's
  fused AdamW or SGD with momentum; bitsandbytes' own ``AdamW8bit``, ``PagedAdamW8bit``'s and
  ``PagedAdamW``'s state through bitsandbytes' own classes (their ops have fake kernels, so the
  uint8 moments, the fp32 maxima of each 256-block and the optimizer's two quantisation maps
  are allocated by bitsandbytes itself, on the first step, as on a device); paged state lives in
  CUDA unified memory (:data:`memlab.step.low_bit.PAGED`), so its bytes leave the device timeline
  for ``host_bytes``; ``transformers.optimization.Adafactor`` (the Trainer's ``adafactor``)
  runs itself (pure torch), its factored rows and columns included.
* **a 4-bit base** (QLoRA): every decoder ``Linear`` replaced by :class:`Linear4bitSim`, whose
  packed weight and quantisation state come from bitsandbytes' own ``quantize_4bit`` (fake
  kernels; ``Params4bit`` itself cannot wrap a fake tensor) and whose matmul is
  :class:`MatMul4BitSim`: bitsandbytes 0.50's ``MatMul4Bit`` (``autograd/_functions.py``
  lines 300-386) with its ``gemm_4bit`` run as the kernel bitsandbytes runs for a training
  matmul (``backends/default/ops.py`` lines 323-342, CPU's; CUDA takes the same dequantise and
  ``F.linear`` fallback past ``_gemm_4bit_custom_max_m`` rows, ``backends/cuda/ops.py`` lines
  947-978): it saves only the packed weight (``ctx.tensors = (None, B)``, line 358) and
  dequantises the weight as a temporary in forward and again in backward (line 384). An 8-bit
  base (``Linear8bitLt``) keeps one int8 per element and an fp32 scale per row and dequantises
  its weight to the input's dtype in forward and backward (``MatMul8bitFp``, the CPU path,
  ``autograd/_functions.py``).
* **ZeRO 1-3 and offload**: the step runs unsharded in DeepSpeed's compute dtype (the module
  cast to it, adapters included); its model states are then put in DeepSpeed's layout per
  rank (:func:`memlab.lenses.simulate.deepspeed_layout`) from :func:`memlab.step.decoder_states.run_states`,
  the frozen base of a LoRA run held beside the adapters' shards; ZeRO-2's ranks differ by their
  gradient partitions (:func:`memlab.step.states.zero2_partition_elements`, in the class's
  parameter order), so its report is the largest rank's, with ``per_rank`` every rank's.

:func:`build_run` and :func:`memlab.hf.config.causal_lm_step` are also what :func:`memlab.hf.measure.measure_hf`
runs for real, so the two lenses run one step.
"""
from __future__ import annotations

import pathlib
from dataclasses import replace
from typing import Callable

import torch
from torch import nn

from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.core.torch_private import FakeTensor
from memlab.hf.config import (
    ROUTING_NOTE,
    build_fn,
    causal_lm_step,
    check_seq,
    fake_grouped_mm,
    is_moe,
    load_config,
)
from memlab.hf.litgpt_simulate import build_litgpt_run
from memlab.hf.shape import FAMILIES, decoder_shape
from memlab.lenses.decoder_estimate import check_run
from memlab.lenses.litgpt_estimate import NORM_BYTES, check_implementation, implementation_notes
from memlab.lenses.simulate import deepspeed_layout, page_out
from memlab.lenses.your_model import simulate_model
from memlab.models.litgpt_model import litgpt_step
from memlab.policy import precision_bytes, resolve_target
from memlab.step.decoder_states import adapter_shapes, adapters_for, run_states
from memlab.step.fine_tune_config import LoraConfig, QuantConfig
from memlab.step.low_bit import (
    EIGHT_BIT,
    NF4_BLOCK,
    OPTIMIZER_STATES,
    PAGED,
    QMAP_ENTRIES,
    TORCHAO,
    eight_bit_adamw,
    torchao_adamw,
)
from memlab.step.parallel_dims import ParallelDims
from memlab.step.states import ModelStates, ZeroBuckets, with_zero2_partition
from memlab.step.training_step import PRECISIONS, MemoryReport, StepConfig
from memlab.step.zero3_gathers import gathered_by_op, module_params

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class MatMul4BitSim(torch.autograd.Function):
    """bitsandbytes 0.50's ``MatMul4Bit`` (``autograd/_functions.py`` 300-386) with ``gemm_4bit``
    as its training kernel runs it (``backends/default/ops.py`` 323-342): the nested maxima
    dequantised (fp32) plus their offset, the weight dequantised to the input's dtype, then
    ``F.linear``. Saved for backward: only the packed weight (line 358); backward dequantises the
    weight again (``functional.dequantize_4bit``, in the state's dtype, cast to the gradient's)."""

    @staticmethod
    def forward(ctx, A, B, bias, state):
        if state.nested:
            absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(
                state.absmax, state.state2.absmax, state.state2.code, 256, torch.float32) + state.offset
        else:
            absmax = state.absmax
        B_dq = torch.ops.bitsandbytes.dequantize_4bit.default(B, absmax, state.blocksize, state.quant_type,
                                                              state.shape, A.dtype)
        del absmax
        out = torch.nn.functional.linear(A, B_dq, bias)
        ctx.state = state
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(B if ctx.needs_input_grad[0] else None)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (B,) = ctx.saved_tensors
        grad_A = grad_bias = None
        if ctx.needs_input_grad[2]:
            grad_bias = grad_output.sum(0, dtype=ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            from bitsandbytes.functional import dequantize_4bit
            grad_A = torch.matmul(grad_output, dequantize_4bit(B, ctx.state).to(grad_output.dtype))
        return grad_A, None, grad_bias, None


class Linear4bitSim(nn.Linear):
    """A decoder ``Linear`` loaded in 4 bits (bitsandbytes' ``Linear4bit``) on fake tensors: the
    packed weight (``uint8``, ``ceil(n / 2)`` bytes as ``(n + 1) // 2 x 1``) and the quantisation
    state ``quantize_4bit`` makes (maxima per block of 64, double quantised or fp32, the offset,
    the NF4/FP4 code), the input cast to the compute dtype, :class:`MatMul4BitSim`, and the
    output cast back (``Linear4bit.forward``, ``nn/modules.py``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quant: QuantConfig):
        import bitsandbytes as bnb
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        packed, state = bnb.functional.quantize_4bit(
            weight.contiguous(), blocksize=NF4_BLOCK, compress_statistics=quant.double_quant,
            quant_type=quant.quant_type, quant_storage=torch.uint8)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.quant_state = state
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.compute_dtype = _DTYPES[quant.compute_dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return MatMul4BitSim.apply(x, self.weight, bias, self.quant_state).to(inp_dtype)


class MatMul8bitSim(torch.autograd.Function):
    """An int8 weight with one fp32 scale per row, dequantised to the input's dtype for the
    matmul in forward and again for the input's gradient (``MatMul8bitFp``); saves the int8
    weight and its scales only."""

    @staticmethod
    def forward(ctx, A, CB, SCB, bias):
        w = CB.to(A.dtype) * SCB.unsqueeze(1).to(A.dtype) / 127
        out = torch.nn.functional.linear(A, w, bias)
        ctx.save_for_backward(CB, SCB)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        CB, SCB = ctx.saved_tensors
        grad_A = None
        if ctx.needs_input_grad[0]:
            w = CB.to(grad_output.dtype) * SCB.unsqueeze(1).to(grad_output.dtype) / 127
            grad_A = torch.matmul(grad_output, w)
        return grad_A, None, None, None


class Linear8bitSim(nn.Linear):
    """A decoder ``Linear`` loaded in 8 bits (``Linear8bitLt``, ``Int8Params``): an int8 weight
    and an fp32 scale per output row (``SCB``), :class:`MatMul8bitSim`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quant: QuantConfig):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(torch.empty(weight.shape, dtype=torch.int8), requires_grad=False)
        self.register_buffer("SCB", torch.empty(weight.shape[0], dtype=torch.float32))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return MatMul8bitSim.apply(x, self.weight, self.SCB, self.bias)


def quantize_base(model: nn.Module, quant: QuantConfig, fake: bool) -> nn.Module:
    """Every ``Linear`` of the decoder layers in bitsandbytes' 4- or 8-bit layout (what
    ``from_pretrained(quantization_config=BitsAndBytesConfig(...))`` converts: the embeddings,
    the head and the norms stay): real ``Linear4bit`` modules quantised on the CPU, or on fake
    tensors :class:`Linear4bitSim` / :class:`Linear8bitSim`."""
    import bitsandbytes as bnb
    qmaps = bnb.functional.name2qmap
    saved = dict(qmaps)
    if fake:  # the nested maxima's map, one per process (quantize_blockwise's name2qmap), fake here
        qmaps["dynamic"] = torch.empty(QMAP_ENTRIES, dtype=torch.float32)
    try:
        _replace_linears(model, quant, fake)
    finally:
        qmaps.clear()
        qmaps.update(saved)
    return model


def _replace_linears(model: nn.Module, quant: QuantConfig, fake: bool) -> None:
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D
    decoder = model.get_decoder()
    for layer in getattr(decoder, "layers", None) or decoder.h:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) not in (nn.Linear, Conv1D):
                    continue
                # GPT-2's Conv1D keeps its weight as (in, out): transformers converts it to a Linear4bit
                weight = child.weight.detach().t() if type(child) is Conv1D else child.weight.detach()
                if fake:
                    new = (Linear4bitSim if quant.bits == 4 else Linear8bitSim)(weight, child.bias, quant)
                elif quant.bits == 4:
                    new = bnb.nn.Linear4bit(weight.shape[1], weight.shape[0], bias=child.bias is not None,
                                            compute_dtype=_DTYPES[quant.compute_dtype],
                                            compress_statistics=quant.double_quant, quant_type=quant.quant_type,
                                            device="meta")
                    new.weight = bnb.nn.Params4bit(weight.contiguous(), requires_grad=False,
                                                   compress_statistics=quant.double_quant,
                                                   quant_type=quant.quant_type)._quantize(weight.device)
                    if child.bias is not None:
                        new.bias = nn.Parameter(child.bias.data, requires_grad=False)
                else:
                    raise InputError("measure of an 8-bit base: allowed: a 4-bit base (bitsandbytes' CPU "
                                     "8-bit training path is not measured here)")
                setattr(parent, name, new)


def make_optimizer(params: list, optimizer: str, lr: float = 1e-4, fake: bool = False):
    """The optimizer the run names (:data:`memlab.step.low_bit.OPTIMIZER_STATES`): torch's fused AdamW,
    SGD with momentum 0.9, bitsandbytes' ``AdamW8bit`` / ``PagedAdamW8bit`` / ``PagedAdamW``, or the
    Trainer's ``adafactor`` (``transformers.optimization.Adafactor`` with ``scale_parameter`` and
    ``relative_step`` off), or torchao's low-bit AdamW (:func:`memlab.step.low_bit.torchao_adamw`).
    On fake tensors the paged ones run as their unpaged twins (the same
    state; unified memory cannot be faked), whose state the simulation moves to the host."""
    if optimizer not in OPTIMIZER_STATES:
        raise InputError(f"optimizer={optimizer!r}; allowed: {', '.join(OPTIMIZER_STATES)}")
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if optimizer == "adafactor":
        from transformers.optimization import Adafactor
        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False)
    if optimizer in EIGHT_BIT:
        return eight_bit_adamw(params, optimizer, lr, fake)
    if optimizer in TORCHAO:
        return torchao_adamw(params, optimizer, lr, fake)
    import bitsandbytes as bnb
    return bnb.optim.AdamW(params, lr=lr) if fake else bnb.optim.PagedAdamW(params, lr=lr)


def build_run(cfg: dict, *, precision: str = "fp32", checkpointing: str | None = None,
              attention: str | None = None, optimizer: str = "adamw", lora: LoraConfig | None = None,
              quantization: QuantConfig | None = None, cast_adapters: bool = False,
              lr: float = 1e-4, optimizer_in_backward: bool = False, reward_head: bool = False) -> Callable:
    """:func:`memlab.hf.config.build_fn` of one run: the weights in the compute dtype under a quantised
    base (:func:`quantize_base`, fake or real as the tensors it is built on), peft's adapters
    (fp32 by peft's ``autocast_adapter_dtype``; in the base's dtype when ``cast_adapters``, as
    DeepSpeed casts the whole module, or ``adapter_dtype="base"``), :func:`make_optimizer`
    (one per parameter, stepped in backward, with ``optimizer_in_backward``); ``reward_head``: a
    reward model's sequence classifier (:func:`memlab.hf.config.build_fn`)."""
    linears = decoder_shape(cfg).linear_names() if lora is not None else None
    base16 = precision == "pure-bf16" and quantization is None
    own = lora is not None and (cast_adapters or (base16 and lora.adapter_dtype == "base"))

    def prepare(model):
        if quantization is None:
            return model
        return quantize_base(model, quantization, isinstance(next(model.parameters()), FakeTensor))

    def optimizer_fn(params):
        return make_optimizer(params, optimizer, lr, bool(params) and isinstance(params[0], FakeTensor))
    return build_fn(cfg, precision=precision, checkpointing=checkpointing, attention=attention,
                    lora=None if lora is None else lora.peft_kwargs(linears), lr=lr,
                    dtype=None if quantization is None else _DTYPES[quantization.compute_dtype],
                    prepare=prepare, autocast_adapter_dtype=not own, optimizer=optimizer_fn,
                    optimizer_in_backward=optimizer_in_backward, reward_head=reward_head)


def simulate_hf(cfg: dict | str | pathlib.Path, *, seq: int, batch: int, precision: str = "fp32",  # noqa: PLR0913 keyword-only: the run's fields, as estimate_hf's
                checkpointing: str | None = None, attention: str | None = None,
                target: str | None = "cuda", budget: int | str | None = None, card=None,
                expert_parallel: int = 1, imbalance: float = 1.0, optimizer: str = "adamw",
                zero: int = 0, world_size: int = 1, offload: str = "none", micro_batches: int = 1,
                lora: LoraConfig | None = None, quantization: QuantConfig | None = None,
                buckets: ZeroBuckets | None = None, loss: str = "transformers",
                loss_chunk: int = 1024, optimizer_in_backward: bool = False,
                implementation: str = "transformers") -> MemoryReport:
    """One optimizer step of the run on fake tensors, per rank (see the module doc).

    Args:
        cfg, seq, batch, precision, checkpointing, attention, target, budget, card, optimizer,
            zero, world_size, offload, micro_batches, lora, quantization, buckets, loss,
            loss_chunk, optimizer_in_backward, implementation: as :func:`memlab.hf.estimate.estimate_hf`
            (``batch``: sequences per rank per optimizer step; ``implementation`` a litgpt commit:
            memlab's copy of litgpt's model and step, :mod:`memlab.hf.litgpt_simulate`).
        expert_parallel, imbalance: 1 only (an expert-parallel rank is estimated, not simulated).

    Returns:
        A :class:`MemoryReport` (lens ``"simulate"``); ``host_bytes`` holds paged and offloaded state.

    Raises:
        InputError: a run argument that is not allowed.
    """
    d = load_config(cfg)
    check_seq(d, seq)
    plain = (optimizer, zero, world_size, offload, micro_batches, lora, quantization, loss,
             optimizer_in_backward) == ("adamw", 0, 1, "none", 1, None, None, "transformers", False)
    if d["model_type"] not in FAMILIES:  # transformers' class runs; the run's states need the shape
        if not plain:
            raise InputError(f"model_type {d['model_type']!r}: simulated as one AdamW step on one device; "
                             f"the run's options need a family memlab reads: {', '.join(FAMILIES)}")
        return _simulate_plain(d, seq=seq, batch=batch, precision=precision, checkpointing=checkpointing,
                               attention=attention, target=resolve_target(target, budget, card), budget=budget)
    s = decoder_shape(d)
    run = StepConfig(s, seq=seq, batch=batch, precision=precision, checkpointing=checkpointing, attention=attention,
                     optimizer=optimizer, micro_batches=micro_batches, zero=zero, world_size=world_size,
                     offload=offload, lora=lora, quantization=quantization, loss=loss, loss_chunk=loss_chunk,
                     buckets=buckets, optimizer_in_backward=optimizer_in_backward, implementation=implementation,
                     parallel=ParallelDims(expert=expert_parallel, expert_imbalance=imbalance))
    check_implementation(run)
    check_run(s, attention=attention, ep=expert_parallel, zero=zero, world_size=world_size, offload=offload,
              micro_batches=micro_batches, lora=lora)
    if loss == "chunked" and s.final_softcap:
        raise InputError(f"loss='chunked' on {s.model_type}: its logits are soft-capped "
                         f"(final_logit_softcapping={s.final_softcap}); allowed: loss='transformers'")
    if expert_parallel != 1:
        raise InputError(f"expert_parallel={expert_parallel}: one process simulates all experts; "
                         f"allowed: 1 (memlab estimate counts an expert-parallel rank)")
    if isinstance(lora, dict):
        raise InputError("lora: a memlab.step.fine_tune_config.LoraConfig (peft's keywords are its peft_kwargs())")
    tgt = resolve_target(target, budget, card)
    ad = None if lora is None else adapters_for(s, lora, precision, quantization is not None)
    rs = run_states(s, precision=precision, optimizer=optimizer, zero=zero, world_size=world_size,
                    offload=offload, ep=1, ad=ad, quant=quantization, buckets=buckets)
    ms = rs.states
    run_precision = rs.run_precision
    build, step = _build_and_step(d, run, run_precision, ms.deepspeed)
    with fake_grouped_mm():
        report = simulate_model(build, step, target=tgt,
                                budget=None if ms.deepspeed else budget, seq=seq, batch=batch,
                                precision=run_precision, checkpointing=checkpointing or "none")
    if ms.deepspeed:
        report = _deepspeed_ranks(report, d, run, rs, ad, build)
        report.budget_bytes = resolve_budget(budget)
    if optimizer in PAGED:
        page_out(report, optimizer, rs.host.get("optimizer", 0.0))
    report.step = run
    for rep in report.per_rank or []:
        rep.step, rep.budget_bytes = run, report.budget_bytes
    report.notes.extend(implementation_notes(run, rs.notes, simulated=True))
    if micro_batches > 1:
        report.notes.append(f"{micro_batches} micro-batches of {batch // micro_batches}, simulated in turn")
    if is_moe(d):
        report.notes.append(ROUTING_NOTE)
    return report


def _build_and_step(d: dict, run: StepConfig, run_precision: str, deepspeed: bool) -> tuple[Callable, Callable]:
    """The run's ``build_fn`` and ``step_fn``: transformers' class and :func:`memlab.hf.config.causal_lm_step`,
    or for a litgpt ``implementation`` memlab's copy of litgpt's model and loop
    (:func:`memlab.hf.litgpt_simulate.build_litgpt_run`, :func:`memlab.models.litgpt_model.litgpt_step`)."""
    if run.implementation in NORM_BYTES:
        def optimizer_fn(params):
            return make_optimizer(params, run.optimizer, fake=bool(params) and isinstance(params[0], FakeTensor))
        build = build_litgpt_run(run.model_config, run.seq, run.lora, run.quantization, run.implementation,
                                 optimizer_fn)
        return build, litgpt_step(run.seq, run.batch, run.model_config.vocab)
    build = build_run(d, precision=run_precision, checkpointing=run.checkpointing, attention=run.attention,
                      optimizer=run.optimizer, lora=run.lora, quantization=run.quantization,
                      cast_adapters=deepspeed and run_precision == "pure-bf16",
                      optimizer_in_backward=run.optimizer_in_backward)
    return build, causal_lm_step(run.seq, run.batch, run_precision, micro_batches=run.micro_batches, loss=run.loss,
                                 loss_chunk=run.loss_chunk)


def _deepspeed_ranks(report: MemoryReport, d: dict, run: StepConfig, rs, ad, build: Callable) -> MemoryReport:
    """The simulated step's model states put in DeepSpeed's layout for ``run``'s ZeRO stage
    (:func:`memlab.lenses.simulate.deepspeed_layout`): ZeRO-3's gathered weights op by op, ZeRO-2's
    ranks by their gradient partitions (:func:`_zero2_ranks`). ``rs``: the run's
    :class:`memlab.step.decoder_states.RunStates`; ``ad``: its adapters or ``None``."""
    s, elem = run.model_config, precision_bytes(rs.run_precision)[0]
    trainable = s.num_params() if ad is None else sum(r * c for r, c in adapter_shapes(s, ad))
    gathered = zero3_gathered(build, report.timeline, run.buckets or ZeroBuckets(), run.world_size,
                              elem) if run.zero == 3 else None
    laid = replace(rs.states, parameters=rs.inputs["parameters"])
    if run.zero == 2 and run.world_size > 1:
        # the order of what trains, from the run without its 4-/8-bit base: bitsandbytes cannot
        # quantise a meta tensor, and the adapters' shapes follow the Linear's features either way
        sizes = trainable_numels(build_run(d, lora=run.lora))
        return _zero2_ranks(report, laid, sizes, run.world_size, trainable * elem)
    deepspeed_layout(report, laid, trainable * elem, gathered)
    return report


def trainable_numels(build: Callable) -> list[int]:
    """Elements of each trainable parameter of :func:`build_run`'s model, in its ``parameters()``
    order (what DeepSpeed flattens and partitions), the model made on the meta device."""
    with torch.device("meta"):
        model, _ = build()
    return [p.numel() for p in model.parameters() if p.requires_grad]


def _zero2_ranks(report: MemoryReport, ms: ModelStates, sizes: list[int], world_size: int,
                 full_grads: float) -> MemoryReport:
    """ZeRO-2's layout on each rank (:func:`memlab.lenses.simulate.deepspeed_layout`): the ranks
    differ only in their gradient partition (:func:`memlab.step.states.zero2_partition_elements`:
    the parameters overlapping a rank's share, whole). Returns the largest rank's report, with
    ``per_rank`` one report per rank (ranks with equal partitions share one)."""
    by_size: dict[float, MemoryReport] = {}
    ranks = []
    for r in range(world_size):
        states = with_zero2_partition(ms, sizes, world_size, r)
        if states.gradients not in by_size:
            rep = replace(report, notes=list(report.notes), per_rank=None)
            deepspeed_layout(rep, states, full_grads)
            by_size[states.gradients] = rep
        ranks.append(by_size[states.gradients])
    top = max(ranks, key=lambda rep: rep.peak_bytes)
    top = replace(top, notes=list(top.notes), per_rank=ranks)
    top.notes.append(f"ZeRO-2 over {world_size} ranks: each rank's gradient partition holds the parameters "
                     f"overlapping its share whole (DeepSpeed's grads_in_partition); the largest rank's peak, "
                     f"per_rank every rank's")
    return top


def zero3_gathered(build: Callable, timeline: list, buckets: ZeroBuckets, world_size: int,
                   element_bytes: int) -> list[float]:
    """ZeRO-3's gathered bytes at each op of ``timeline`` (:func:`memlab.step.zero3_gathers.gathered_by_op`):
    the model of ``build`` is made on the meta device for its modules' own parameters, named as
    the tracker names modules (the root's class, then the module's path).

    Args:
        build: :func:`build_run`'s callable.
        timeline: the simulated unsharded step's events.
        buckets: the run's DeepSpeed sizes (memlab's config writes ``max_live`` as the reuse distance).
        world_size: ranks.
        element_bytes: bytes of a gathered element.

    Returns:
        One figure per event.
    """
    with torch.device("meta"):
        model, _ = build()
    params_of, trainable = module_params(model)
    return gathered_by_op(timeline, params_of, trainable, world_size=world_size, element_bytes=element_bytes,
                          prefetch=buckets.prefetch, max_live=buckets.max_live, reuse_distance=buckets.max_live,
                          persistence=buckets.persistence)


def _simulate_plain(d: dict, *, seq: int, batch: int, precision: str, checkpointing: str | None,
                    attention: str | None, target, budget) -> MemoryReport:
    """One AdamW step of any causal LM transformers has (no shape read: nothing of the run needs one)."""
    if precision not in PRECISIONS:
        raise InputError(f"precision={precision!r} for a Hugging Face step; allowed: {', '.join(PRECISIONS)}")
    if (checkpointing or "none") not in ("none", "full"):
        raise InputError(f"checkpointing={checkpointing!r} for a Hugging Face model; allowed: none, full")
    with fake_grouped_mm():
        report = simulate_model(build_run(d, precision=precision, checkpointing=checkpointing, attention=attention),
                                causal_lm_step(seq, batch, precision), target=target, budget=budget, seq=seq,
                                batch=batch, precision=precision, checkpointing=checkpointing or "none")
    report.step = replace(report.step, name=(d.get("architectures") or [d["model_type"]])[0])
    if is_moe(d):
        report.notes.append(ROUTING_NOTE)
    return report


__all__ = ["MatMul4BitSim", "Linear4bitSim", "MatMul8bitSim", "Linear8bitSim", "quantize_base",
           "make_optimizer", "build_run", "simulate_hf", "trainable_numels"]
