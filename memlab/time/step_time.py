"""How long one training step takes on a card: the time lens beside the memory lenses.

The rule, part by part (each a few lines below, and in :attr:`StepTime.rule`):

* **compute** = (forward + backward FLOPs) / (peak x achievable), **recompute** = the
  recomputed FLOPs / the same rate. FLOPs come from :mod:`memlab.time.flops` (per rank: divided by
  the tensor- and pipeline-parallel degrees); the peak is the card's datasheet figure for the
  dtype the matmuls run in (:class:`memlab.core.cards.Speeds`: bf16/fp16 under autocast or
  DeepSpeed's 16-bit mode, fp32 otherwise: torch leaves TF32 off for matmuls by default);
  ``achievable`` is the fraction published training runs reach on that card (cited in
  :data:`memlab.core.cards.SPEEDS`), applied to the rate of a Linear's three training GEMMs ``memlab
  doctor --calibrate`` measured on this card in place of the datasheet's peak (:func:`calibrated_rate`).
  On a card, memlab's GPT is timed GEMM by GEMM (:func:`matmul_rate`): each of a rank's
  matmuls (Megatron-LM's tensor-parallel split) takes the longer of its FLOPs at that rate and
  its operands' bytes at HBM's bandwidth (:func:`gemm_seconds`), so skinny GEMMs run below it.
  The attention term (``s^2``) runs at its fused kernel's rate where that was measured (the
  CPU's flash attention computes bf16 in fp32 blocks: about 20 GFLOP/s on an AVX2 host whose
  bf16 GEMMs reach 3), else at the matmuls'.
* **communication** = bytes moved on the GPU links (:mod:`memlab.time.communication`) / the
  link's one-way bandwidth (NVLink within a node of up to 8 GPUs, where the card has it, else
  PCIe), less what the engine overlaps: DDP all-reduces its buckets while backward runs
  (Li et al. 2020, sec. 3.2.3), so only what outlasts backward shows; memlab's DeepSpeed
  config sets ``overlap_comm: false`` (:func:`memlab.step.write_deepspeed_config.deepspeed_config`),
  so ZeRO's collectives are all exposed; tensor parallelism's all-reduces sit between a
  layer's matmuls (Megatron-LM sec. 3): exposed, on NVLink (a TP group sits in a node);
  pipeline sends: exposed. ``gradient_sync="step"``: one all-reduce per step (Megatron-LM),
  which DDP overlaps with the last micro-batch's backward only.
* **offload**: the PCIe transfers and the host's Adam over its parameter shard
  (``cpu_adam_params_per_s``, measured by ``memlab doctor --calibrate``, else
  :data:`CPU_ADAM_PARAMS_PER_S`). DeepSpeed runs them in series after backward (its
  ``step()`` runs the host's Adam, then copies the weights up: stage_1_and_2.py:3078-3097,
  no delayed parameter update), so ``offload`` = PCIe + CPU Adam; an engine that overlaps
  them (ZeRO-Offload's delayed update) takes the slowest of the GPU's work, PCIe and CPU Adam.
* **bubble** (pipeline, ``p`` stages, ``m`` micro-batches): ``(p - 1) / m`` of the compute
  (Narayanan et al. 2021, sec. 2.2.1); under the interleaved schedule with ``v`` model chunks
  per rank, ``(p - 1) / (v m)``, and ``v`` times the point-to-point sends (sec. 2.2.2).
* **elementwise**: the bytes forward and backward's elementwise ops read and write
  (:mod:`memlab.time.elementwise`: norms, activation functions, residual adds, casts, the loss) over
  the card's memory bandwidth (HBM's datasheet figure, or the rate ``memlab doctor
  --calibrate`` measured of a streaming add), a roofline per op class: the activation
  functions take the longer of their bytes at that bandwidth and their elements at the rate
  measured of tanh-GELU forward and backward (a CPU computes each ``tanh`` or ``exp``: there
  they are compute-bound; a card's datasheet has no such limit). What recompute re-runs is
  filed under ``recompute``. Per rank: divided by the tensor- and pipeline-parallel degrees,
  as sequence parallelism shards it (Korthikanti et al. 2022, sec. 4.2.2).

* **LoRA and QLoRA** (``lora_rank``, ``qlora``): each adapter's small GEMMs are timed by their
  own roofline (:func:`adapter_time`; at rank 8-16 their bytes decide), and a 4-bit base
  weight's dequantisation crosses HBM each time a matmul reads it (:func:`dequant_4bit_bytes`,
  bitsandbytes' dequantise-then-``F.linear`` path past 1536 rows; torchtune's torchao ``NF4Tensor``,
  eager or fused by torch.compile: :func:`dequant_nf4_torchao`), filed under compute and,
  for what checkpointing re-runs, recompute.

* **engine**: the per-step work around the matmuls that the engine does over the parameters:
  every kernel-launching op is a host launch (:data:`LAUNCH_SECONDS`), every ``.item()`` a
  host sync (:data:`SYNC_SECONDS`), and the bytes those passes read and write cross HBM at the
  card's bandwidth. Plain torch: AdamW's foreach step over fp32 state (:data:`ADAMW_BYTES`,
  :data:`ADAMW_FOREACH_OPS` foreach ops of ``ceil(elements / FOREACH_ELEMENTS)`` launches).
  Under DeepSpeed 0.19.8 the passes of its optimizer wrapper, counted on its code path
  (:data:`DEEPSPEED_PASSES`, recounted by :func:`memlab.distributed.comm_count.count_deepspeed_passes`):
  per parameter tensor the ops and syncs ``engine.step()`` launches outside torch's AdamW and
  the ops it adds to forward and backward (hidden behind the GPU's compute unless they sync),
  per element the bytes of its flat-buffer casts and copies plus AdamW's. Offloaded, the flat
  buffers and Adam live on the host: their passes are the host's, timed with CPU Adam.

Over 500 lines because each part of the rule sits beside the constants and DeepSpeed lines it
cites, so one step's seconds can be followed, part by part, in one file.

Left out: the host's launch of each elementwise op (hidden behind the GPU's work while the
kernels outlast it), the Python of DeepSpeed's hooks beyond the ops they launch (ZeRO-3's
parameter coordinator above all), the data loader, and the network between nodes (a group
over 8 GPUs uses PCIe's figure).
"""
from __future__ import annotations

import json
import math
import os
import pathlib
from dataclasses import dataclass, field, replace

from memlab.core.cards import SPEEDS, Card, Speeds, card_speeds, get_card
from memlab.core.errors import InputError
from memlab.models.decoder_shape import DecoderShape
from memlab.models.gpt_unet import GPTConfig, UNetConfig
from memlab.step.low_bit import EIGHT_BIT
from memlab.step.states import under_deepspeed
from memlab.time.communication import StepComm, step_communication
from memlab.time.elementwise import ElementwiseWork, count_flops_and_elementwise, deepspeed_precision, step_elementwise
from memlab.time.flops import StepFlops, block_matmuls, layer_matmuls, lora_matmuls, step_flops_formula

#: torch.optim.AdamW on the host, parameters per second, used when ``memlab doctor
#: --calibrate`` has not measured this host: the H200 reference's host ran ZeRO-Offload's
#: step of gpt2-large (774M parameters) in 1.65 s, 1.43 s more than on the GPU
#: (memlab/data/reference/NVIDIA-H200/README.md): about 5.4e8 parameters/s
CPU_ADAM_PARAMS_PER_S = 774_030_080 / (1.65 - 0.22)
#: where ``memlab doctor --calibrate`` keeps what it measured (``MEMLAB_CALIBRATION`` overrides)
CALIBRATION_ENV = "MEMLAB_CALIBRATION"
PARTS = ("compute", "recompute", "elementwise", "communication", "engine", "offload", "bubble")
NODE_GPUS = 8  # GPUs one NVLink domain joins in the DGX/HGX boards the datasheets describe

#: host seconds per kernel-launching op: CUDA's own launch, 4-6 us of driver and runtime calls
#: per kernel (susun-blog.com/blog/pegainfer-3-cuda-graph, "From Launch Overhead to CUDA Graph",
#: RTX 5070 Ti, CUDA 13.0; its benchmark synchronises the stream after every launch, so the
#: figure is a launch and its wait, more than an asynchronous launch costs the host), taken at
#: 5 us, plus PyTorch's dispatch of the op from Python, of the same order: 10 us (a stated
#: default: nothing in memlab measures it yet)
LAUNCH_SECONDS = 10e-6
#: a host sync (``.item()``): its launch, a device-to-host copy and the wait for the stream to
#: drain, so the host and the GPU stop overlapping: counted as two launches
SYNC_SECONDS = 2 * LAUNCH_SECONDS
#: elements one foreach kernel covers: 320 blocks of 65536 (``depth_to_max_blocks``,
#: ``kChunkSize`` in aten/src/ATen/native/cuda/MultiTensorApply.cuh)
FOREACH_ELEMENTS = 320 * 65536
#: torch.optim.AdamW's foreach step on CUDA (torch/optim/adam.py ``_multi_tensor_adam``, not
#: capturable): step += 1 on the host, then 8 passes over the fp32 elements: params *= 1 - lr wd
#: (4 B read, 4 written), exp_avg.lerp_(grad) (8 + 4), exp_avg_sq *= beta2 (4 + 4),
#: exp_avg_sq.addcmul_(grad, grad) (8 + 4), sqrt (4 + 4), / bias correction (4 + 4), + eps
#: (4 + 4), params.addcdiv_(exp_avg, denom) (12 + 4)
ADAMW_FOREACH_OPS = 8
ADAMW_BYTES = 8 + 12 + 8 + 12 + 8 + 8 + 8 + 16


#: launches of one 4-bit weight's dequantisation with double quantisation (bitsandbytes
#: 0.50.2: ``dequantize_blockwise`` of the 8-bit absmax, ``+= offset``, ``dequantize_4bit``)
DEQUANT_4BIT_LAUNCHES = 3


def dequant_4bit_bytes(elements: int, *, blocksize: int = 64, nested: bool = True, out_bytes: int = 2) -> float:
    """HBM bytes bitsandbytes moves to dequantise one 4-bit weight of ``elements`` for a matmul.

    bitsandbytes 0.50.2 (its files as at bitsandbytes-foundation/bitsandbytes@37d2a938, tag 0.50.1,
    ``backends/cuda/ops.py:954``): past 1536 rows of input (``_gemm_4bit_custom_max_m``,
    line 926) its ``gemm_4bit`` takes ``_gemm_4bit_default_impl`` (``backends/default/ops.py:323-345``):
    under double quantisation (``nested``) ``dequantize_blockwise`` turns the 8-bit absmax (one per
    ``blocksize`` weights, with an fp32 absmax per 256 of them) into fp32, ``+ absmax_offset``
    reads and writes it again, then ``dequantize_4bit`` reads the packed weight (half a byte each)
    and the fp32 absmax and writes the weight in the input's dtype (``out_bytes``), which
    ``F.linear`` reads as a bf16 weight would be (counted with the GEMM). Backward dequantises
    again for the input's gradient (``autograd/_functions.py:384``, ``MatMul4Bit.backward``, through
    ``functional.dequantize_4bit``, lines 1052-1063: the same three kernels, ``absmax += offset`` in place).

    Args:
        elements: the weight's elements; blocksize: weights per absmax (QLoRA's 64);
        nested: double quantisation (QLoRA's and torchtune's default); out_bytes: the
        dequantised dtype's bytes.

    Returns:
        Bytes read and written per dequantisation.
    """
    if elements < 1 or blocksize < 1:
        raise InputError(f"elements={elements!r}, blocksize={blocksize!r}; allowed: positive integers")
    blocks = elements / blocksize
    absmax = blocks * ((1 + 4 / 256 + 4) + (4 + 4) + 4) if nested else blocks * 4
    return elements / 2 + absmax + elements * out_bytes


#: where the 4-bit base's dequantisation runs: bitsandbytes' kernels (:func:`dequant_4bit_bytes`), or
#: torchao's ``NF4Tensor`` (torchtune's QLoRA, :func:`dequant_nf4_torchao`) in eager ops or fused by torch.compile
DEQUANT_BACKENDS = ("bitsandbytes", "torchao-eager", "torchao-compiled")


@dataclass(frozen=True)
class Dequant:
    """One 4-bit weight's dequantisation for a matmul: HBM ``bytes`` read and written, kernel ``launches``."""

    bytes: float
    launches: int


def dequant_nf4_torchao(elements: int, *, compiled: bool, block_size: int = 64, scaler_block_size: int = 256,
                        out_bytes: int = 2) -> Dequant:
    """What torchao's ``NF4Tensor`` moves to dequantise one weight of ``elements`` for a matmul.

    torchtune's QLoRA (``torchtune/modules/peft/lora.py`` at 30b8519e, ``LoRALinear.forward``:
    ``linear_nf4(input=x, weight=self.weight)``) runs torchao's ``LinearNF4``
    (``torchao/dtypes/nf4tensor.py`` at 5e558f50, lines 1063-1074): forward ``F.linear(input,
    weight.to(input.dtype))``, backward ``grad_output @ weight.to(grad_output.dtype)``: the whole
    weight is dequantised to bf16 both times (``_to_copy`` -> ``get_original_weight``, lines 386-393,
    855-889), then a plain GEMM reads it (counted with the GEMM). ``get_original_weight`` in eager
    runs 13 kernels over ``n`` elements: ``>> 4`` and ``& 0b1111`` on the packed bytes (n/2 read, n/2
    written each), each ``.to(torch.long)`` (n/2 read, 4n written), two ``nf4[idx]`` lookups (4n read,
    n written each), ``dequantize_scalers`` over the n/64 int8 scalers (``/ factor``, ``+ mean``:
    7n/64), ``repeated.flatten()`` twice, once per ``*``, each copying the expanded scalers (n/32
    read, n written), two ``*`` (3n each), ``torch.stack`` (4n): about 33 bytes an element. Under
    ``torch.compile`` (torchtune's README rows; ``NF4Tensor`` is a traceable subclass, so Inductor
    fuses the chain into one kernel) it reads the packed weight (n/2), the int8 scalers (n/64) and
    their bf16 factors (2n/16384) and writes the bf16 weight once: about 2.52 bytes an element.

    Args:
        elements: the weight's elements; compiled: under ``torch.compile`` (one fused kernel);
        block_size, scaler_block_size: torchao's defaults (``to_nf4``: 64, 256); out_bytes: bf16's 2.

    Returns:
        :class:`Dequant`.
    """
    if elements < 1 or block_size < 1 or scaler_block_size < 1:
        raise InputError(f"elements={elements!r}, block_size={block_size!r}, scaler_block_size={scaler_block_size!r}; "
                         f"allowed: positive integers")
    n = float(elements)
    scalers = n / block_size
    if compiled:
        return Dequant(n / 2 + scalers + 2 * scalers / scaler_block_size + n * out_bytes, 1)
    half = n / 2
    unpack = 2 * (half + half) + 2 * (half + 8 * half)  # >> and &, then each .to(long)
    lookup = 2 * (8 * half + out_bytes * half)  # nf4[first], nf4[second]
    dq_scalers = (scalers + 2 * scalers) + (2 * scalers + 2 * scalers)  # int8 / factor -> bf16, + mean
    repeat = 2 * (2 * scalers + out_bytes * half)  # each "* repeated.flatten()" copies the expanded scalers
    scale = 2 * 3 * out_bytes * half  # dequantized_first * repeated, the same for second
    stack = 2 * out_bytes * n  # torch.stack reads both halves, writes the weight
    return Dequant(unpack + lookup + dq_scalers + repeat + scale + stack, 13)


def dequant_time_bytes(elements: int, backend: str, *, out_bytes: int = 2) -> Dequant:
    """One 4-bit weight's dequantisation on ``backend`` (one of :data:`DEQUANT_BACKENDS`)."""
    if backend == "bitsandbytes":
        return Dequant(dequant_4bit_bytes(elements, out_bytes=out_bytes), DEQUANT_4BIT_LAUNCHES)
    if backend in ("torchao-eager", "torchao-compiled"):
        return dequant_nf4_torchao(elements, compiled=backend == "torchao-compiled", out_bytes=out_bytes)
    raise InputError(f"dequant={backend!r}; allowed: {', '.join(DEQUANT_BACKENDS)}")


@dataclass(frozen=True)
class AdapterTime:
    """LoRA's adapters in one step: their GEMMs by the roofline (``seconds``, of which
    ``recompute_seconds`` re-run under full checkpointing), their ``flops`` (``recompute_flops``),
    the QLoRA base weights' dequantisation bytes (``dequant_bytes``, ``dequant_recompute_bytes``)
    and the kernel ``launches`` both add (hidden behind the GPU while kernels outlast them)."""

    seconds: float
    recompute_seconds: float
    flops: float
    recompute_flops: float
    dequant_bytes: float = 0.0
    dequant_recompute_bytes: float = 0.0
    launches: float = 0.0


def adapter_time(cfg: GPTConfig | DecoderShape, tokens: int, rank: int, targets, *, checkpointing: str,
                 peak: float, achievable: float, hbm: float, elem_bytes: int = 2, qlora: bool = False,
                 dequant: str = "bitsandbytes") -> AdapterTime:
    """LoRA's small GEMMs of one micro-batch of ``tokens`` and, with ``qlora``, the 4-bit base
    weights' dequantisation (:func:`dequant_4bit_bytes`), per the tuned matmuls of each layer.

    Each adapter ``x A B`` runs two GEMMs forward (``t x k x r``, ``t x r x o``) and four backward
    (B's weight gradient and the gradient into ``xA``, A's weight gradient and the input's), each
    timed by :func:`gemm_seconds`: at rank 8-16 they are bandwidth-bound. Full checkpointing
    re-runs the forward's two, except the block's last matmul (``down``/``c_proj``: only ``A``, as
    :func:`memlab.time.flops.gpt_step_flops` counts). A QLoRA base weight is dequantised forward,
    backward, and on recompute except for that last matmul.

    Args:
        cfg: memlab's GPT or a decoder's shape; tokens: of one micro-batch; rank, targets: the
            adapters (HF names; a decoder also takes ``"all-linear"``).
        checkpointing: ``none``, ``selective`` or ``full``; peak, achievable, hbm, elem_bytes:
            as :func:`gemm_seconds`; qlora: the tuned Linears' base weights are 4-bit;
        dequant: whose kernels dequantise them (:data:`DEQUANT_BACKENDS`, :func:`dequant_time_bytes`).

    Returns:
        :class:`AdapterTime` of the whole model.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InputError(f"lora rank={rank!r}; allowed: a positive integer")
    fw = rec = fl = fl_rec = dq = dq_rec = launches = 0.0

    def g(m, k, n):
        return gemm_seconds(m, k, n, peak=peak, achievable=achievable, hbm=hbm, elem_bytes=elem_bytes), 2 * m * k * n

    # memlab's GPT: every block alike (one counted, times the layers); a decoder's layers differ
    layers = range(cfg.n_layer) if isinstance(cfg, DecoderShape) else range(1)
    for layer in layers:
        last = block_matmuls(cfg, layer)[-1][0]
        for part, i, o in lora_matmuls(cfg, targets, layer):
            (a_s, a_f), (b_s, b_f) = g(tokens, i, rank), g(tokens, rank, o)
            back = [g(rank, tokens, o), g(tokens, o, rank), g(i, tokens, rank), g(tokens, rank, i)]
            fw += a_s + b_s + sum(x for x, _ in back)
            fl += a_f + b_f + sum(f for _, f in back)
            launches += 6
            if checkpointing == "full":
                rec += a_s + (b_s if part != last else 0.0)
                fl_rec += a_f + (b_f if part != last else 0)
                launches += 2 if part != last else 1
            if qlora:
                once = dequant_time_bytes(i * o, dequant, out_bytes=elem_bytes)
                dq += 2 * once.bytes
                launches += 2 * once.launches
                if checkpointing == "full" and part != last:
                    dq_rec += once.bytes
                    launches += once.launches
    n = 1 if isinstance(cfg, DecoderShape) else cfg.n_layer
    return AdapterTime(fw * n, rec * n, fl * n, fl_rec * n, dq * n, dq_rec * n, launches * n)


@dataclass(frozen=True)
class EnginePasses:
    """DeepSpeed's work per step beyond the module's forward and backward, on one code path.

    ``step_ops``/``step_syncs``: kernel-launching ops and ``.item()`` syncs ``engine.step()``
    runs outside torch's AdamW, per parameter tensor; ``step_bytes``: the bytes those ops read
    and write, per parameter element (they run over the flat buffers); ``extra_ops``/
    ``extra_syncs``: what DeepSpeed adds to forward + backward per tensor (gradient hooks,
    bucket copies); ``where``: the lines of DeepSpeed 0.19.8 that run them.
    """

    optimizer: str
    step_ops: float
    step_syncs: float
    step_bytes: float
    extra_ops: float
    extra_syncs: float
    where: str


#: counted by :func:`memlab.distributed.comm_count.count_deepspeed_passes` (bf16, torch AdamW,
#: used for fp32 runs of ZeRO 1-3 too: the same loops without the casts; fp32 at ZeRO 0 is
#: :data:`DEEPSPEED_FP32_STAGE0`,
#: memlab's :func:`~memlab.step.write_deepspeed_config.deepspeed_config`, one rank); the
#: per-tensor counts are those of GPT-2's block (12 tensors), the byte counts per element hold
#: for any model (elementwise passes over the parameters)
DEEPSPEED_PASSES: dict[tuple[int, str], EnginePasses] = {
    # ZeRO 0 in bf16 with torch AdamW: engine.py:2294-2323 picks DDP_BFLOAT16, engine.py:2560-2600
    # FP16_UnfusedOptimizer (AdamW is no FusedAdam); its step (fp16/unfused_optimizer.py:197-240)
    # checks each gradient for inf/nan with an .item(), takes each norm, unscales and copies each
    # fp32 master into its 16-bit weight (239); backward all-reduces a flattened copy
    # (engine.py:3921 buffered_allreduce_fallback -> 3823 allreduce_and_copy)
    (0, "none"): EnginePasses("FP16_UnfusedOptimizer", 20.007, 1.007, 36.0, 1.011, 0.0,
                              "engine.py:2294-2323, 2560-2600, 3823-3935; fp16/unfused_optimizer.py:197-240"),
    # ZeRO 1 and 2 (bf16 gradients accumulate in bf16: engine.py:1806, so not BF16_Optimizer):
    # stage_1_and_2.py:3013 step: check_overflow per tensor (3030), the scaled global norm per
    # tensor (3039), the bf16 gradients flattened and cast to the fp32 partition (3114-3118),
    # unscale and clip (3133), AdamW (3139), the fp32 partition copied into the bf16 one (3145)
    # and all-gathered (3155); backward hooks copy each gradient into the reduce bucket
    # (2293 reduce_ready_partitions_and_remove_grads, 1590 average_tensor)
    (1, "none"): EnginePasses("DeepSpeedZeroOptimizer", 15.131, 0.007, 48.0, 2.023, 0.0,
                              "zero/stage_1_and_2.py:1590, 2293, 3013-3160"),
    (2, "none"): EnginePasses("DeepSpeedZeroOptimizer", 15.131, 0.007, 48.0, 2.023, 0.0,
                              "zero/stage_1_and_2.py:1590, 2293, 3013-3160"),
    # ZeRO 3: stage3.py:2873 step over flat fp32 sub-groups (2683 fp32 gradients, 2979 unscale,
    # 1235 AdamW, 2854 the 16-bit partition rewritten); backward reduce hooks (1509, 1648)
    (3, "none"): EnginePasses("DeepSpeedZeroOptimizer_Stage3", 2.096, 0.002, 44.0, 2.353, 0.0,
                              "zero/stage3.py:1235, 1509, 1648, 2683-2873, 2979"),
    # ZeRO 2 + optimizer offload: backward copies each gradient to the host through the GPU with an
    # overflow check that syncs per tensor (stage_1_and_2.py:1791-1830); step() unscales on the
    # host, runs AdamW there and copies the fp32 partition into a bf16 buffer sent up (3078-3097)
    (2, "optimizer"): EnginePasses("DeepSpeedZeroOptimizer", 1.103, 1.009, 22.0, 18.023, 1.0,
                                   "zero/stage_1_and_2.py:1791-1830, 3078-3097"),
}
DEEPSPEED_PASSES[(1, "optimizer")] = DEEPSPEED_PASSES[(3, "optimizer")] = DEEPSPEED_PASSES[(2, "optimizer")]
#: ZeRO 0 with fp32 weights and gradients: no optimizer wrapper (engine.py:2313-2314 returns
#: None for that pair, so the client's torch AdamW steps alone, no per-tensor overflow check);
#: the engine still flattens the gradients for its all-reduce and copies them back
#: (engine.py:3823 allreduce_and_copy). Counted as the bf16 rows are, with fp32 weights.
DEEPSPEED_FP32_STAGE0 = EnginePasses("AdamW", 2.023, 0.0, 12.0, 1.011, 0.0, "engine.py:2313-2314, 3823-3935")


@dataclass(frozen=True)
class EngineTime:
    """The engine part of a step: host launches and syncs, HBM passes, host passes (offload)."""

    seconds: float
    launches: float
    syncs: float
    hbm_bytes: float
    host_bytes: float = 0.0
    rule: str = ""


def parameter_tensors(cfg) -> int | None:
    """How many parameter tensors a model has (a launch per tensor per per-tensor pass), read
    off memlab's GPT modules (:class:`memlab.models.gpt_unet.GPT`): per block the fused qkv and output
    projections, the MLP's two (three with SwiGLU) Linears, each with a bias where the config
    has one, and two norms (LayerNorm's bias too); then the token (and learned position)
    embedding, the final norm and an untied head; a decoder's from its shape
    (:meth:`memlab.models.decoder_shape.DecoderShape.param_numels`). ``None`` for other models."""
    if isinstance(cfg, DecoderShape):
        return len(cfg.param_numels())
    if not isinstance(cfg, GPTConfig):
        return None
    bias = int(cfg.bias)
    norm = 1 + (bias if cfg.norm == "layernorm" else 0)
    mlp = (3 if cfg.mlp == "swiglu" else 2) * (1 + bias)
    block = (1 + int(cfg.has_qkv_bias)) + (1 + bias) + mlp + 2 * norm
    top = 1 + int(cfg.position == "learned") + norm + int(not cfg.tie_embeddings)
    return cfg.n_layer * block + top


@dataclass(frozen=True)
class OptimizerPass:
    """A plain-torch optimizer step other than fp32 AdamW's foreach pass: the ``elements`` it
    updates, the HBM ``bytes`` per element it reads and writes, the kernel ``launches``."""

    elements: float
    bytes: float
    launches: float
    name: str = ""


def optimizer_pass(kind: str, elements: float, tensors: int) -> OptimizerPass:
    """The optimizer step's pass over ``elements`` in ``tensors`` tensors.

    ``"adamw"``: :data:`ADAMW_BYTES` (fp32 state); ``"adamw-bf16"``: the same passes over bf16
    weights and state (half the bytes: pure bf16); ``"adamw-8bit"``: bitsandbytes' blockwise
    8-bit Adam, one fused kernel per tensor that reads the fp32 weight and gradient and the two
    1-byte states and writes the weight and states back: 4 + 4 + 2 + 4 + 2 = 16 bytes.
    """
    if kind == "adamw":
        return OptimizerPass(elements, ADAMW_BYTES, ADAMW_FOREACH_OPS * max(1, -(-int(elements) // FOREACH_ELEMENTS)),
                             kind)
    if kind == "adamw-bf16":
        return OptimizerPass(elements, ADAMW_BYTES / 2,
                             ADAMW_FOREACH_OPS * max(1, -(-int(elements) // FOREACH_ELEMENTS)), kind)
    if kind == "adamw-8bit":
        return OptimizerPass(elements, 16, tensors, kind)
    raise InputError(f"optimizer pass {kind!r}; allowed: adamw, adamw-bf16, adamw-8bit")


def engine_time(step, hbm: float, *, deepspeed: bool, hidden: float, tensors: int | None = None,
                launch_seconds: float = LAUNCH_SECONDS, optimizer: OptimizerPass | None = None,
                model_parallel: int = 1) -> EngineTime:
    """The engine part of ``step`` per the module doc.

    Args:
        step: the step (``batch`` per rank). hbm: the card's HBM bytes/s.
        deepspeed: the step runs under DeepSpeed (ZeRO 0 included) rather than plain torch.
        hidden: seconds of GPU work (forward + backward) the host's un-synced launches overlap.
        tensors: parameter tensors (default :func:`parameter_tensors`).
        launch_seconds: host seconds per launch (default :data:`LAUNCH_SECONDS`).
        optimizer: plain torch's optimizer pass (default fp32 AdamW over every parameter; memlab's
            GPT with an 8-bit AdamW: bitsandbytes' pass, :func:`optimizer_pass`).
        model_parallel: tensor x pipeline degree: each rank steps its ``1 / model_parallel``
            of the parameters.

    Returns:
        :class:`EngineTime` (all zero for a model memlab cannot count).
    """
    cfg = step.model_config
    tensors = parameter_tensors(cfg) if tensors is None else tensors
    if tensors is None:
        return EngineTime(0.0, 0, 0, 0, rule="engine: model not countable, left out")
    n = cfg.num_params() / model_parallel
    if deepspeed:
        shard = n if step.zero == 0 else n / step.world_size
        passes = DEEPSPEED_PASSES[(step.zero, "none" if step.offload == "none" else "optimizer")]
        if step.zero == 0 and step.offload == "none" and compute_dtype(step) == "fp32":
            passes = DEEPSPEED_FP32_STAGE0
        # ZeRO-3's offload runs stage3.py's own loops: the stage-2 offload passes stand in
    else:
        shard, passes = n, None
    adam_launches = ADAMW_FOREACH_OPS * max(1, -(-int(shard) // FOREACH_ELEMENTS))
    offloaded = step.offload != "none"
    if passes is None:
        # memlab's GPT with bitsandbytes' 8-bit AdamW (StepConfig.optimizer): its one kernel per tensor
        eight = isinstance(cfg, GPTConfig) and getattr(step, "optimizer", None) in EIGHT_BIT
        opt = optimizer or optimizer_pass("adamw-8bit" if eight else "adamw", shard, tensors)
        launches, syncs, hbm_bytes = opt.launches, 0.0, opt.bytes * opt.elements
        extra = 0.0
    else:
        launches = passes.step_ops * tensors + (0 if offloaded else adam_launches)
        syncs = (passes.step_syncs + passes.extra_syncs) * tensors
        hbm_bytes = 0.0 if offloaded else (passes.step_bytes + ADAMW_BYTES) * shard
        extra_host = passes.extra_ops * tensors * launch_seconds
        # launches in forward/backward overlap the GPU's work unless a sync makes the host wait
        extra = extra_host if passes.extra_syncs else max(0.0, extra_host - hidden)
    host_bytes = (passes.step_bytes + ADAMW_BYTES) * shard if passes is not None and offloaded else 0.0
    seconds = launches * launch_seconds + syncs * launch_seconds * (SYNC_SECONDS / LAUNCH_SECONDS) \
        + hbm_bytes / hbm + (extra if passes is not None else 0.0)
    where = passes.where if passes is not None else "torch/optim/adam.py _multi_tensor_adam"
    rule = (f"engine: {launches:.0f} launches x {launch_seconds * 1e6:g} us + {syncs:.0f} syncs + "
            f"{hbm_bytes / 1e9:.3g} GB / {hbm / 1e12:g} TB/s HBM ({where})")
    return EngineTime(seconds, launches, syncs, hbm_bytes, host_bytes, rule)


@dataclass(frozen=True)
class TimeParts:
    """Seconds of one step by part (module doc); ``communication_bytes`` is what those
    seconds move on the GPU links, ``pcie_bytes`` over PCIe."""

    compute: float
    recompute: float
    communication: float
    offload: float
    bubble: float
    communication_bytes: float = 0.0
    pcie_bytes: float = 0.0
    engine: float = 0.0
    elementwise: float = 0.0

    @property
    def total(self) -> float:
        return (self.compute + self.recompute + self.elementwise + self.communication + self.engine
                + self.offload + self.bubble)


@dataclass(frozen=True)
class StepTime:
    """The time lens of one step: its FLOPs (always), and on a card its seconds, by part,
    tokens per second and MFU (model FLOPs, without recompute, over seconds x peak: PaLM,
    Chowdhery et al. 2022, appendix B). ``bound`` names what limits an offloaded step."""

    flops: StepFlops
    seconds: float | None = None
    by_part: TimeParts | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    card: str | None = None
    bound: str = "gpu"
    communication: StepComm = field(default_factory=StepComm)
    rule: str = ""
    elementwise: ElementwiseWork | None = None

    def to_dict(self) -> dict:
        d = {"flops": self.flops.to_dict(),
             "elementwise": self.elementwise.to_dict() if self.elementwise is not None else None,
             "seconds": self.seconds, "tokens_per_second": self.tokens_per_second,
             "mfu": self.mfu, "card": self.card, "bound": self.bound, "rule": self.rule}
        if self.by_part is not None:
            d["by_part"] = {p: getattr(self.by_part, p) for p in PARTS}
            d["by_part"]["communication_bytes"] = self.by_part.communication_bytes
            d["by_part"]["pcie_bytes"] = self.by_part.pcie_bytes
        d["communication"] = self.communication.to_dict()
        return d


@dataclass(frozen=True)
class Calibration:
    """What ``memlab doctor --calibrate`` measured: a Linear's training GEMMs' FLOP/s per dtype on a
    device, the host's AdamW parameters per second, and fused causal attention's FLOP/s per
    dtype (forward and backward, counted as :mod:`memlab.time.flops` counts them: the full square)
    where it was measured; per dtype, the bytes per second of a streaming add and the elements
    per second of tanh-GELU forward and backward (:class:`ElementwiseRates`)."""

    device: str
    matmul_flops: dict[str, float]
    cpu_adam_params_per_s: float
    attention_flops: dict[str, float] = field(default_factory=dict)
    elementwise_bytes: dict[str, float] = field(default_factory=dict)
    activation_elements: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ElementwiseRates:
    """How fast a device runs elementwise work: the bytes per second a streaming op (an add)
    reads and writes, and the elements per second tanh-GELU's forward and backward produce
    (``inf``: no limit beyond bandwidth, a card's datasheet default)."""

    bytes_per_s: float
    activation_elements_per_s: float = math.inf


def elementwise_seconds(work: ElementwiseWork, rates: ElementwiseRates) -> float:
    """Seconds of ``work`` at ``rates`` (the module doc's roofline per op class)."""
    streaming = (work.bytes - work.activation_bytes) / rates.bytes_per_s
    activations = max(work.activation_bytes / rates.bytes_per_s,
                      work.activation_elements / rates.activation_elements_per_s)
    return streaming + activations


def calibrated_elementwise(card_name: str, dtype: str, calibration: Calibration | None) -> ElementwiseRates | None:
    """The elementwise rates ``memlab doctor --calibrate`` measured on this card in ``dtype``,
    or ``None``."""
    if calibration is None or calibration.device != card_name or dtype not in calibration.elementwise_bytes:
        return None
    return ElementwiseRates(calibration.elementwise_bytes[dtype],
                            calibration.activation_elements.get(dtype, math.inf))


def calibration_path() -> pathlib.Path:
    """Where the calibration lives: ``$MEMLAB_CALIBRATION`` or ``~/.cache/memlab/calibration.json``."""
    env = os.environ.get(CALIBRATION_ENV)
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "memlab" / "calibration.json"


def load_calibration(path: pathlib.Path | None = None) -> Calibration | None:
    """The stored calibration, or ``None`` when there is none (or it cannot be read)."""
    p = path or calibration_path()
    try:
        d = json.loads(p.read_text())
        return Calibration(d["device"], {k: float(v) for k, v in d["matmul_flops"].items()},
                           float(d["cpu_adam_params_per_s"]),
                           {k: float(v) for k, v in d.get("attention_flops", {}).items()},
                           {k: float(v) for k, v in d.get("elementwise_bytes", {}).items()},
                           {k: float(v) for k, v in d.get("activation_elements", {}).items()})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def compute_dtype(step) -> str:
    """The dtype a step's matmuls run in: bf16/fp16 under autocast and in DeepSpeed's 16-bit
    mode (bf16 unless fp32), else fp32."""
    if step.precision in ("bf16", "pure-bf16"):
        return "bf16"
    if step.precision == "fp16":
        return "fp16"
    return "fp32"


def calibrated_rate(card_name: str, dtype: str, calibration: Calibration | None, *,
                    attention: bool = False) -> float | None:
    """FLOP/s a step reaches per the calibration, when it was measured on this card: the
    measured matmul rate takes the datasheet peak's place (``measured x achievable``), so a
    card whose matmuls run slower than its datasheet (clocks, power cap) is timed slower.
    ``attention``: the fused attention kernel's measured rate instead. ``None`` without a
    calibration of this card and dtype."""
    measured = (calibration.attention_flops if attention else calibration.matmul_flops) if calibration else {}
    if calibration is None or calibration.device != card_name or dtype not in measured:
        return None
    return measured[dtype] * card_speeds(card_name).achievable


def gemm_seconds(m: int, k: int, n: int, *, peak: float, achievable: float, hbm: float,
                 elem_bytes: int) -> float:
    """Seconds of one ``(m x k) @ (k x n)`` GEMM by a roofline: the longer of its FLOPs at
    ``peak x achievable`` (what a large GEMM reaches) and the bytes of its two inputs and its
    output at HBM's bandwidth. A Linear's backward GEMMs (input and weight gradients) permute
    the same three matrices, so each takes the forward's time. A skinny GEMM (LoRA's rank-16
    ``n``) does ``~n`` FLOPs per byte and is bandwidth-bound: far below peak.

    Args:
        m, k, n: the GEMM's dimensions (``m`` tokens, ``k`` in, ``n`` out).
        peak: FLOP/s of the dtype (datasheet, or ``memlab doctor --calibrate``'s measure).
        achievable: the fraction of ``peak`` a large GEMM reaches (:data:`memlab.core.cards.SPEEDS`).
        hbm: bytes/s; elem_bytes: bytes per element of the operands.

    Returns:
        Seconds.
    """
    for name, v in (("m", m), ("k", k), ("n", n)):
        if v < 1:
            raise InputError(f"GEMM dimension {name}={v!r}; allowed: a positive integer")
    return max(2 * m * k * n / (peak * achievable), elem_bytes * (m * k + k * n + m * n) / hbm)


def matmul_rate(cfg: GPTConfig | DecoderShape, tokens: int, *, tensor_parallel: int, peak: float, achievable: float,
                hbm: float, elem_bytes: int) -> float:
    """FLOP/s a model's matmuls reach together: each layer's GEMM and the head timed by
    :func:`gemm_seconds` on one rank's shard (Megatron-LM's split, Narayanan et al. 2021 sec.
    2.3: the first Linear of attention and of the MLP split by columns, the second by rows, the
    head by the vocabulary), their FLOPs over their seconds.

    Args:
        cfg: memlab's GPT or a decoder's shape (a routed expert's GEMM on its ``top_k / experts``
            share of the rows: balanced routing); tokens: of one micro-batch; tensor_parallel: the TP degree.
        peak, achievable, hbm, elem_bytes: as :func:`gemm_seconds`.

    Returns:
        FLOP/s, at most ``peak x achievable``.
    """
    t = tensor_parallel
    column = {"qkv", "q", "k", "v", "up", "gate"}
    decoder = isinstance(cfg, DecoderShape)
    shapes: list[tuple[int, int, int]] = []  # (rows, in, out) of each GEMM of one rank
    for layer in range(cfg.n_layer if decoder else 1):
        for part, i, o, _, rows in layer_matmuls(cfg, layer):
            m = tokens if rows == 1 else max(1, tokens * rows // cfg.experts)  # one expert's rows
            k, n = ((i, max(1, o // t)) if part in column else (i, o) if part == "router" else (max(1, i // t), o))
            shapes += [(m, k, n)] * (cfg.experts if rows != 1 else 1)
    if not decoder:
        shapes = shapes * cfg.n_layer
    d, vocab = (cfg.d, cfg.vocab) if decoder else (cfg.d_model, cfg.vocab_size)
    shapes.append((tokens, d, max(1, vocab // t)))
    flops = sum(2 * m * k * n for m, k, n in shapes)
    seconds = sum(gemm_seconds(m, k, n, peak=peak, achievable=achievable, hbm=hbm, elem_bytes=elem_bytes)
                  for m, k, n in shapes)
    return flops / seconds


def step_time(step, card: Card | str | None = None, *, flops: StepFlops | None = None,  # noqa: PLR0913 keyword-only: the time lens's knobs, each documented
              speeds: Speeds | None = None, calibration: Calibration | None = None,
              cpu_adam_params_per_s: float | None = None, engine: str | None = None,
              optimizer: OptimizerPass | None = None, attention_flops_per_s: float | None = None,
              elementwise: ElementwiseWork | None = None, elementwise_rates: ElementwiseRates | None = None,
              target: str | None = None, gradient_sync: str = "micro-batch",
              sequence_parallel: bool = True, lora_rank: int | None = None, lora_targets=(),
              qlora: bool = False, dequant: str = "bitsandbytes", virtual_stages: int = 1,
              whole_forward_recompute: bool = False, dp_overlap: bool = True,
              network: float | None = None) -> StepTime:
    """The time of one step of ``step`` (a :class:`memlab.step.training_step.StepConfig`, ``batch`` per
    rank) on ``card``, by the module doc's rule.

    Over 80 lines because its docstring documents each of the time lens's knobs; the body,
    about 70 lines, sums the parts its helpers time (:func:`_adapter_seconds`,
    :func:`_elementwise_parts`, :func:`_communication_seconds`, :func:`_offload_seconds`).

    Args:
        step: the step; its ``parallel`` degrees (tensor, pipeline) divide its ``world_size`` ranks.
        card: a profile or its name; ``None``: the FLOPs only (no card, no seconds).
        flops: the step's FLOPs if already counted (default :func:`memlab.time.flops.step_flops_formula`).
        speeds: datasheet figures to use instead of the card's (a card memlab has none for).
        calibration: ``memlab doctor --calibrate``'s figures (default: the stored ones).
        cpu_adam_params_per_s: the host's AdamW throughput (default: calibrated, else
            :data:`CPU_ADAM_PARAMS_PER_S`).
        engine: ``"deepspeed"`` or ``"torch"`` (default: DeepSpeed where ZeRO or offload is on);
            ``"deepspeed"`` with ZeRO 0 is DeepSpeed's engine without partitioning.
        optimizer: plain torch's optimizer pass (:func:`optimizer_pass`; default fp32 AdamW).
        attention_flops_per_s: the rate the attention term (``flops.attention``) runs at, a
            fused kernel's own (default: the calibration's for this card and dtype times
            ``achievable``, else the matmuls' rate).
        elementwise: the step's elementwise work if already counted (default
            :func:`memlab.time.elementwise.step_elementwise` on ``target``).
        elementwise_rates: the device's (default: the calibration's for this card and dtype,
            else the card's HBM bandwidth and no compute limit).
        target: whose autocast lists and kernels the elementwise work follows (default
            ``"cuda"`` on a card, ``"cpu"`` with ``speeds`` alone).
        gradient_sync: ``"micro-batch"`` (memlab's trainer all-reduces after each) or
            ``"step"`` (once per step, as Megatron-LM does; DDP then overlaps it with the last
            micro-batch's backward only).
        sequence_parallel: the elementwise ops shard over the tensor-parallel ranks
            (Korthikanti et al. 2022, sec. 4.2.2; its reduce-scatter and all-gather move what
            TP's all-reduce does); ``False``: Megatron-LM before it, every TP rank runs the
            norms, dropouts and residual adds of the whole sequence.
        lora_rank, lora_targets: LoRA adapters (``flops`` should then count them:
            :func:`memlab.time.flops.gpt_step_flops` with the same rank and targets); their small GEMMs
            are timed by their own roofline (:func:`adapter_time`) instead of the matmuls' rate.
        qlora: the tuned Linears' base weights are 4-bit (bitsandbytes' NF4 with double
            quantisation): their dequantisation's bytes cross HBM each time a matmul reads them.
        dequant: whose kernels dequantise them (:data:`DEQUANT_BACKENDS`): bitsandbytes' (peft,
            the Trainer), torchao's NF4Tensor in eager ops or under torch.compile (torchtune).
        virtual_stages: model chunks per pipeline rank, the interleaved schedule (Narayanan
            et al. 2021, sec. 2.2.2): the bubble is ``(p - 1) / (v m)`` of the work and the
            pipeline's sends grow ``v``-fold; 1: plain 1F1B.
        whole_forward_recompute: full checkpointing re-runs each layer's whole forward with both
            of its tensor-parallel all-reduces (Megatron-LM's reentrant checkpoint; pass ``flops``
            whose recompute is the forward's): :func:`memlab.time.communication.step_communication`.
        dp_overlap: plain data parallelism all-reduces its buckets while backward runs (torch's DDP);
            ``False``: after the pipeline schedule, exposed, as Megatron-LM's DDP does unless
            ``--overlap-grad-reduce`` is set (a ``store_true`` flag, default off: megatron/training.py
            ``get_model`` at NVIDIA/Megatron-LM@974d0fa9).
        network: bytes/s one way per GPU between nodes (a group over :data:`NODE_GPUS`), the
            cluster's own figure (Selene: one 200 Gb/s HCA per GPU, 25e9); default the card's PCIe.

    Returns:
        :class:`StepTime`.
    """
    if dequant not in DEQUANT_BACKENDS:
        raise InputError(f"dequant={dequant!r}; allowed: {', '.join(DEQUANT_BACKENDS)}")
    if gradient_sync not in ("micro-batch", "step"):
        raise InputError(f"gradient_sync={gradient_sync!r}; allowed: micro-batch, step")
    if engine not in (None, "deepspeed", "torch"):
        raise InputError(f"engine={engine!r}; allowed: deepspeed, torch")
    on_ds = under_deepspeed(step.zero, step.offload) if engine is None else engine == "deepspeed"
    closed = isinstance(step.model_config, (GPTConfig, DecoderShape))  # the closed forms read it
    if isinstance(step.model_config, DecoderShape) and lora_rank is None and step.lora is not None:
        # a decoder's run carries its adapters and its 4-bit base
        lora_rank, lora_targets = step.lora.rank, step.lora.targets
        qlora = qlora or (step.quantization is not None and step.quantization.bits == 4)
    if isinstance(step.model_config, UNetConfig) and flops is None and elementwise is None and \
            (card is not None or speeds is not None):
        # no closed form (a UNet): both counted in one fake step
        flops, elementwise = count_flops_and_elementwise(
            replace(step, precision=deepspeed_precision(step)) if on_ds else step)
    flops = flops or step_flops_formula(step)
    t, p = step.parallel.tensor, step.parallel.pipeline
    comm = step_communication(step, sync_every_micro_batch=gradient_sync == "micro-batch",
                              virtual_stages=virtual_stages, whole_forward_recompute=whole_forward_recompute)
    if card is None and speeds is None:
        return StepTime(flops, communication=comm, rule="no card: FLOPs only")
    if isinstance(card, str):
        card = get_card(card)
    name = card.name if card is not None else "custom"
    sp = speeds or card_speeds(card)
    calibration = calibration if calibration is not None else load_calibration()
    dtype = compute_dtype(step)
    large_gemm = calibrated_rate(name, dtype, calibration) or sp.peak(dtype) * sp.achievable
    rate = large_gemm
    if card is not None and closed:
        # each GEMM under its roofline (gemm_seconds), at the large-GEMM rate found above
        rate = matmul_rate(step.model_config, step.seq * step.batch // step.micro_batches,
                           tensor_parallel=t, peak=rate / sp.achievable, achievable=sp.achievable,
                           hbm=sp.hbm, elem_bytes=2 if dtype in ("bf16", "fp16") else 4)
    attn_rate = attention_flops_per_s or calibrated_rate(name, dtype, calibration, attention=True) or rate
    share = t * p
    # the attention term at its kernel's rate, the rest at the matmuls'; the seconds are split
    # between the parts by their FLOPs (memlab.time.flops counts attention over all three together)
    total = flops.total or 1
    seconds_per_flop = ((flops.total - flops.attention) / rate + flops.attention / attn_rate) / total
    compute = flops.model / share * seconds_per_flop
    recompute = flops.recompute / share * seconds_per_flop
    if lora_rank is not None and card is not None and closed:
        more, more_recompute = _adapter_seconds(step, sp, share, lora_rank, lora_targets, qlora=qlora,
                                                dequant=dequant, peak=large_gemm / sp.achievable, dtype=dtype,
                                                seconds_per_flop=seconds_per_flop)
        compute, recompute = compute + more, recompute + more_recompute
    ew = elementwise or step_elementwise(step, target or ("cuda" if card is not None else "cpu"), deepspeed=on_ds)
    rates = elementwise_rates or calibrated_elementwise(name, dtype, calibration) or ElementwiseRates(sp.hbm)
    elementwise_s, elementwise_recompute = _elementwise_parts(
        step, ew, rates, share, tensor_parallel=t, whole_sequence=not sequence_parallel and elementwise is None,
        target=target or "cuda", on_ds=on_ds, closed=closed)
    recompute += elementwise_recompute
    synced = step.micro_batches if gradient_sync == "step" else 1  # a once-a-step sync hides behind one backward
    comm_s, gpu_link, overlap = _communication_seconds(
        step, comm, sp, t, dp_overlap=dp_overlap, network=network, backward=flops.backward / share / rate / synced)
    m = step.micro_batches
    bubble = (p - 1) / (virtual_stages * m) * (compute + recompute + elementwise_s) if p > 1 else 0.0
    eng = engine_time(step, sp.hbm, deepspeed=on_ds, hidden=compute + recompute + elementwise_s,
                      optimizer=optimizer, model_parallel=share)
    gpu = compute + recompute + elementwise_s + comm_s + bubble + eng.seconds
    offload, bound = _offload_seconds(step, comm, sp, gpu, share, on_ds=on_ds, adam_rate=(
        cpu_adam_params_per_s or (calibration.cpu_adam_params_per_s if calibration is not None else None)
        or CPU_ADAM_PARAMS_PER_S))
    seconds = gpu + offload
    tokens = step.seq * step.batch * (step.world_size // share)  # the data-parallel replicas' tokens
    peak_all = sp.peak(dtype) * step.world_size
    mfu = flops.model * (step.world_size // share) / (seconds * peak_all) if seconds > 0 else None
    parts = TimeParts(compute, recompute, comm_s, offload, bubble, comm.gpu_bytes, comm.pcie_bytes, eng.seconds,
                      elementwise_s)
    rule = (f"compute = FLOPs / ({dtype} peak {sp.peak(dtype) / 1e12:g} TFLOP/s x "
            f"{rate / sp.peak(dtype):.2f} achievable); elementwise = {ew.bytes / 1e9:.3g} GB / "
            f"{rates.bytes_per_s / 1e9:.3g} GB/s (activations: the longer of that and their elements at "
            f"{rates.activation_elements_per_s / 1e9:.3g} G/s); communication = {comm.gpu_bytes / 1e9:.3g} GB / "
            f"{gpu_link / 1e9:g} GB/s ({overlap}); {eng.rule}; offload: slowest of GPU, PCIe, CPU Adam; "
            f"bubble (p-1)/m")
    return StepTime(flops, seconds, parts, tokens / seconds if seconds > 0 else None, mfu, name, bound,
                    comm, rule, ew)


def _adapter_seconds(step, sp: Speeds, share: int, lora_rank: int, lora_targets, *, qlora: bool, dequant: str,
                     peak: float, dtype: str, seconds_per_flop: float) -> tuple[float, float]:
    """Seconds LoRA's adapters add per rank, outside recomputation and inside it: their FLOPs
    leave the matmuls' rate (``seconds_per_flop``) for their own roofline
    (:func:`adapter_time`, at the large-GEMM ``peak``), plus QLoRA's dequantisation bytes."""
    adapters = adapter_time(step.model_config, step.seq * step.batch // step.micro_batches, lora_rank,
                            lora_targets, checkpointing=step.checkpointing_used,
                            peak=peak, achievable=sp.achievable, hbm=sp.hbm,
                            elem_bytes=2 if dtype in ("bf16", "fp16") else 4, qlora=qlora, dequant=dequant)
    m_b = step.micro_batches / share
    return (m_b * (adapters.seconds + adapters.dequant_bytes / sp.hbm - adapters.flops * seconds_per_flop),
            m_b * (adapters.recompute_seconds + adapters.dequant_recompute_bytes / sp.hbm
                   - adapters.recompute_flops * seconds_per_flop))


def _elementwise_parts(step, ew: ElementwiseWork, rates: ElementwiseRates, share: int, *, tensor_parallel: int,
                       whole_sequence: bool, target: str, on_ds: bool, closed: bool) -> tuple[float, float]:
    """Seconds of the step's elementwise work per rank, outside recomputation and inside it.

    ``whole_sequence``: without sequence parallelism every TP rank runs the ops over the d-wide
    residual stream whole (norms, residual adds: outside TP's split, Korthikanti et al. 2022
    sec. 4.2.1), ``tensor_parallel - 1`` more times; the MLP's and attention's elementwise ops
    stay split over the TP ranks, as do the weights' casts. ``closed``: ``ew`` is a closed form
    (memlab's GPT or a decoder's shape), which tells the residual stream's bytes apart.
    """
    t = tensor_parallel
    per_byte = elementwise_seconds(ew, rates) / share / ew.bytes if ew.bytes else 0.0
    extra = (0.0, 0.0)
    if whole_sequence and t > 1 and closed:
        extra = ((t - 1) * ew.residual, (t - 1) * ew.residual_recompute)
    return (ew.forward + ew.backward + extra[0]) * per_byte, (ew.recompute + extra[1]) * per_byte


def _communication_seconds(step, comm, sp: Speeds, tensor_parallel: int, *, backward: float, dp_overlap: bool = True,
                           network: float | None = None) -> tuple[float, float, str]:
    """Seconds the step's collectives take on the GPUs' link, the link's bytes/s, and what
    overlaps them: NVLink inside a node (and for TP's groups, which sit inside one: Megatron-LM,
    Narayanan et al. 2021 sec. 3.2), else PCIe; DDP hides its all-reduce behind ``backward``
    seconds (plain PyTorch without ZeRO) unless ``dp_overlap`` is off; ``network``: the link between
    nodes (default PCIe's figure)."""
    gpu_link = sp.nvlink if sp.nvlink and step.world_size <= NODE_GPUS else (network or sp.pcie)
    comm_s = comm.gpu_bytes / gpu_link if comm.gpu_bytes else 0.0
    tp_bytes = comm.by_kind.get("tensor-parallel all-reduces", 0.0)
    if tp_bytes and sp.nvlink and tensor_parallel <= NODE_GPUS:
        comm_s += tp_bytes / sp.nvlink - tp_bytes / gpu_link
    overlap = "none"
    if dp_overlap and step.zero == 0 and not under_deepspeed(step.zero, step.offload):
        dp_s = comm.by_kind.get("data-parallel all-reduce", 0.0) / gpu_link
        comm_s = comm_s - dp_s + max(0.0, dp_s - backward)
        overlap = "DDP overlaps its all-reduce with backward"
    return comm_s, gpu_link, overlap


def _offload_seconds(step, comm, sp: Speeds, gpu: float, share: int, *, on_ds: bool,
                     adam_rate: float) -> tuple[float, str]:
    """Seconds offloading adds to ``gpu`` seconds of device work, and what bounds the step.

    DeepSpeed's step() runs the host's Adam (``adam_rate`` parameters/s), then sends the weights
    up, after backward (stage_1_and_2.py:3078-3097; no delayed parameter update configured): in
    series. Otherwise the slowest of the GPU, PCIe and the host's Adam bounds the step."""
    if step.offload == "none":
        return 0.0, "gpu"
    shard = step.model_config.num_params() / share / (step.world_size // share)
    pcie_s = comm.pcie_bytes / sp.pcie
    adam_s = shard / adam_rate
    if on_ds:
        bound = "cpu adam" if adam_s >= max(gpu, pcie_s) else ("pcie" if pcie_s >= gpu else "gpu")
        return pcie_s + adam_s, bound
    slowest = max(gpu, pcie_s, adam_s)
    return slowest - gpu, "gpu" if slowest == gpu else ("pcie" if slowest == pcie_s else "cpu adam")


def report_time(step, card: Card | None, *, flops: StepFlops | None = None,
                elementwise: ElementwiseWork | None = None) -> StepTime:
    """The ``time`` of a lens's report: on ``card`` when memlab has its figures, else the
    FLOPs alone (the CPU, a card without a datasheet entry)."""
    if card is not None and card.name not in SPEEDS:
        card = None
    return step_time(step, card, flops=flops, elementwise=elementwise)


__all__ = ["report_time", "ADAMW_BYTES", "ADAMW_FOREACH_OPS", "DEEPSPEED_FP32_STAGE0",
           "DEEPSPEED_PASSES", "EnginePasses", "EngineTime",
           "FOREACH_ELEMENTS", "LAUNCH_SECONDS", "AdapterTime", "DEQUANT_4BIT_LAUNCHES", "DEQUANT_BACKENDS", "Dequant",
           "adapter_time", "dequant_nf4_torchao", "dequant_time_bytes",
           "dequant_4bit_bytes", "gemm_seconds", "matmul_rate", "OptimizerPass", "optimizer_pass",
           "SYNC_SECONDS", "engine_time", "parameter_tensors",
           "CALIBRATION_ENV", "CPU_ADAM_PARAMS_PER_S", "Calibration", "ElementwiseRates", "NODE_GPUS",
           "PARTS", "StepTime", "TimeParts", "calibrated_elementwise", "calibrated_rate", "calibration_path",
           "compute_dtype", "elementwise_seconds",
           "load_calibration", "step_time"]
