"""The time lens against runs others published: predicted over published, per row.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", arXiv 2104.04473), sec. 5.1, Table 1: GPT models of 1.7B to 1T parameters on
Selene's A100-80GB (vocabulary 51,200, sequence 2048, mixed precision, activation
recomputation), with their tensor (t), pipeline (p) degrees, GPUs and batch, and the
teraFLOP/s per GPU achieved, counted by the paper's eq. 3 (four passes: forward, two of
backward, the recomputed forward); read in a full-text copy of the paper (find_string id
63285939983, sec. 5.1 and Table 1: every row as below). None of these rows derived a rate the lens
uses (:data:`memlab.core.cards.RATE_LEDGER`, keyed by :data:`memlab.core.cards.MEASURED_ROWS`): the
A100's GEMM fraction is FlashAttention-2's (sec. 1).

What the setups leave open, set here and not tuned: one sequence per micro-batch (the
largest pipeline bubble the paper's batches allow) and plain 1F1B (sec. 5.1 ran the interleaved
schedule, its chunks not stated). What Megatron-LM's code fixes, read: its full recomputation re-runs
each layer's whole forward (eq. 3; ``tensor_parallel.checkpoint`` of whole layers in
``ParallelTransformer._checkpointed_forward``, megatron/model/transformer.py at NVIDIA/Megatron-LM@b35d061e),
so the recompute FLOPs are the forward's and both TP all-reduces re-run; its data-parallel gradient
all-reduce runs after the pipeline schedule, exposed (``--overlap-grad-reduce`` is off by default,
megatron/training.py at @974d0fa9), over Selene's one 200 Gb/s HCA per GPU (sec. 5);
``--bf16``/``--fp16`` wrap the
model in ``Float16Module``, which casts it whole to 16 bits (``module.bfloat16()``,
megatron/model/module.py at NVIDIA/Megatron-LM@46c74b4c): weights, activations and the
residual stream in 16 bits, memlab's ``pure-bf16``, not autocast over fp32 weights; its
attention of 2021-2022 materialises the scores (no flash attention: Korthikanti et al. count
the softmax output and dropout mask, ``5as^2b`` bytes, sec. 4.1): ``attention="naive"``; and
Table 1's runs predate sequence parallelism (Korthikanti et al. 2022), so they run without it.
"""
from __future__ import annotations

import pathlib
from dataclasses import replace

import pytest
from hf_gpt_mapping import gpt_config

from memlab.core.cards import MEASURED_ROWS, RATE_LEDGER
from memlab.models.gpt_unet import GPTConfig
from memlab.step.parallel_dims import ParallelDims
from memlab.step.training_step import StepConfig
from memlab.time.flops import gpt_step_flops
from memlab.time.step_time import StepTime, gemm_seconds, step_time

V, S = 51_200, 2048
#: Selene's link between nodes per GPU, one way: sec. 5 (read), "eight NVIDIA Mellanox 200Gbps HDR
#: Infiniband HCAs for application communication" a node of eight A100s: 200 Gb/s = 25 GB/s a GPU
SELENE_NETWORK = 200e9 / 8
#: Table 1: (billions of parameters, heads, hidden, layers, t, p, GPUs, batch, achieved TFLOP/s per GPU)
NARAYANAN_TABLE_1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)


def narayanan_flops(batch: int, layers: int, hidden: int) -> float:
    """The paper's eq. 3: FLOPs of one iteration, recomputation included."""
    return 96 * batch * S * layers * hidden**2 * (1 + S / (6 * hidden) + V / (16 * layers * hidden))


def megatron_step(heads: int, hidden: int, layers: int, t: int, p: int, gpus: int, batch: int, *,
                  checkpointing: str = "full", sequence_parallel: bool = True, micro_batch: int = 1,
                  virtual_stages: int = 1) -> StepTime:
    """The lens's step of a Megatron-LM GPT on Selene's A100s, ``micro_batch`` sequences per micro-batch."""
    cfg = GPTConfig(name="megatron-gpt", n_layer=layers, n_head=heads, d_model=hidden, vocab_size=V,
                    block_size=S, attention="naive")
    per_replica = batch // (gpus // (t * p))
    step = StepConfig(model=cfg, seq=S, batch=per_replica, micro_batches=per_replica // micro_batch,
                      precision="pure-bf16", world_size=gpus, checkpointing=checkpointing)
    flops = gpt_step_flops(cfg, S, per_replica, checkpointing="none" if checkpointing == "full" else checkpointing)
    if checkpointing == "full":
        flops = replace(flops, recompute=flops.forward)  # Megatron-LM re-runs the whole forward
    return step_time(replace(step, parallel=ParallelDims(tensor=t, pipeline=p)), "A100-80GB", flops=flops,
                     gradient_sync="step", sequence_parallel=sequence_parallel, virtual_stages=virtual_stages,
                     whole_forward_recompute=True, dp_overlap=False, network=SELENE_NETWORK)


def megatron_row(heads: int, hidden: int, layers: int, t: int, p: int, gpus: int, batch: int) -> float:
    """Predicted TFLOP/s per GPU of one Table 1 row (eq. 3's FLOPs over the lens's seconds)."""
    seconds = megatron_step(heads, hidden, layers, t, p, gpus, batch, sequence_parallel=False).seconds
    return narayanan_flops(batch, layers, hidden) / seconds / gpus / 1e12


# Sec. 5.1 (read) says Table 1 ran "the interleaved pipeline schedule with the scatter/gather
# optimization", its chunks a rank not stated: the lens keeps plain 1F1B, whose bubble (p - 1)/m is an
# upper bound. Before Megatron-LM's whole-layer recompute, exposed gradient all-reduce and Selene's
# 25 GB/s network were set, the 39.1B and 76.1B rows were 1.267 and 1.273 (strict xfail).
@pytest.mark.parametrize("row", NARAYANAN_TABLE_1, ids=[f"{r[0]}B" for r in NARAYANAN_TABLE_1])
def test_narayanan_table_1_within_25_percent(row):
    _, heads, hidden, layers, t, p, gpus, batch, published = row
    predicted = megatron_row(heads, hidden, layers, t, p, gpus, batch)
    assert 0.75 <= predicted / published <= 1.25, (predicted, published)


#: the published rows this file holds, as :data:`memlab.core.cards.MEASURED_ROWS` names them
TESTED_HERE = ("narayanan2021-table1", "korthikanti2022-abstract", "korthikanti2022-table4", "korthikanti2022-figure8",
               "korthikanti2022-table5", "dubey2024-table4", "torchtune-4090")


def test_no_rate_derived_from_a_row_that_checks_a_rate():
    """The ledger names measured rows by key. No row that derived any rate checks any rate (so no
    prediction a test holds rests on a constant fitted to its own row), every row this file tests
    checks a rate, and the ledger's values are the lens's own constants."""
    from memlab.time.step_time import CPU_ADAM_PARAMS_PER_S, LAUNCH_SECONDS, dequant_4bit_bytes, dequant_nf4_torchao
    derived = {k for r in RATE_LEDGER for k in r.derived_from}
    checks = {k for r in RATE_LEDGER for k in r.checks}
    assert derived | checks <= set(MEASURED_ROWS), (derived | checks) - set(MEASURED_ROWS)
    assert not derived & checks, derived & checks
    assert set(TESTED_HERE) <= checks, set(TESTED_HERE) - checks
    value = {r.rate.split(" (")[0].split(":")[0]: r.value for r in RATE_LEDGER}
    assert value["host launch per kernel, seconds"] == LAUNCH_SECONDS
    assert value["host AdamW, parameters/s"] == pytest.approx(CPU_ADAM_PARAMS_PER_S)
    n = 4096 * 4096
    assert value["QLoRA dequantisation under bitsandbytes"] == pytest.approx(dequant_4bit_bytes(n) / n, abs=5e-4)
    assert value["QLoRA dequantisation under torchao's NF4Tensor, fused by torch.compile"] == pytest.approx(
        dequant_nf4_torchao(n, compiled=True).bytes / n, abs=5e-4)


def test_skinny_gemm_is_bandwidth_bound():
    """A LoRA rank-16 GEMM on an A100: ~16 FLOPs a byte at 2.039 TB/s, a tenth of the peak's
    rate; a 4096-square GEMM reaches the large-GEMM rate."""
    peak, hbm = 312e12, 2039e9
    m, k = 8192, 4096
    skinny = 2 * m * k * 16 / gemm_seconds(m, k, 16, peak=peak, achievable=0.8, hbm=hbm, elem_bytes=2)
    bytes_moved = 2 * (m * k + k * 16 + m * 16)
    assert skinny == pytest.approx(2 * m * k * 16 / (bytes_moved / hbm))
    assert skinny < 0.11 * peak
    square = 2 * 4096**3 / gemm_seconds(4096, 4096, 4096, peak=peak, achievable=0.8, hbm=hbm, elem_bytes=2)
    assert square == pytest.approx(0.8 * peak)


def test_megatron_gradient_all_reduce_is_exposed_on_the_cluster_network():
    """``dp_overlap=False``: the data-parallel all-reduce adds its bytes over the link, none hidden
    behind backward; ``network`` replaces PCIe's figure between nodes (16 GPUs: two nodes)."""
    step = StepConfig(model="gpt2-small", seq=128, batch=8, micro_batches=4, precision="bf16", world_size=16)
    dp = step_communication_bytes(step)
    hidden = step_time(step, "A100-80GB", gradient_sync="step")
    exposed = step_time(step, "A100-80GB", gradient_sync="step", dp_overlap=False)
    assert exposed.by_part.communication == pytest.approx(dp / 32e9)
    assert hidden.by_part.communication < exposed.by_part.communication
    slow = step_time(step, "A100-80GB", gradient_sync="step", dp_overlap=False, network=SELENE_NETWORK)
    assert slow.by_part.communication == pytest.approx(dp / 25e9)


def step_communication_bytes(step) -> float:
    """The data-parallel all-reduce's bytes a rank sends in a step synced once."""
    from memlab.time.communication import step_communication
    return step_communication(step, sync_every_micro_batch=False).by_kind["data-parallel all-reduce"]


def test_gradient_sync_once_per_step_moves_one_micro_batch_worth():
    """Megatron-LM all-reduces the accumulated gradients once a step: 1/m of memlab's
    per-micro-batch all-reduce; an unknown choice is bad input naming the allowed ones."""
    from memlab.core.errors import InputError
    from memlab.time.communication import step_communication
    step = StepConfig(model="gpt2-small", seq=128, batch=8, micro_batches=4, precision="bf16", world_size=4)
    every = step_communication(step).by_kind["data-parallel all-reduce"]
    once = step_communication(step, sync_every_micro_batch=False).by_kind["data-parallel all-reduce"]
    assert once * 4 == pytest.approx(every)
    with pytest.raises(InputError, match="micro-batch, step"):
        step_time(step, "A100-80GB", gradient_sync="never")


# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", arXiv
# 2205.05198). The abstract (read): the 530B GPT-3-style model on 2240 A100s reaches 54.2% MFU
# with selective recomputation and sequence parallelism, "29% faster than the 42.1% we achieve
# using recomputation" (full, without sequence parallelism). The paper's own PDF could not be opened
# through the tools here; its tables are as two independent full-text reading notes give them, which
# agree on every figure both quote: a Chinese note (find_string id 69499497868, "本次核验范围：全文 17/17
# 页") and an English deep dive (id 55271916660, its sections 11-13). Table 3, the setups: 22B (a=64,
# h=6144, 48 layers, t=8, p=1, 8 GPUs, global batch 4, micro-batch 4); 175B (96, 12288, 96 layers, t=8,
# p=8, 64 GPUs, batch 64, micro-batch 1); 530B (128, 20480, 105, t=8, p=35, 280 GPUs, batch 280,
# micro-batch 1); 1T (160, 25600, 128, t=8, p=64, 512 GPUs, batch 512, micro-batch 1); the 175B and
# 530B run the interleaved schedule with 3 chunks a rank; no data parallelism. Table 4, one 22B layer's
# forward + backward: 19.6 ms without recomputation, 19.0 with sequence parallelism (-3%), 27.2 with
# full recomputation (+39%), 20.9 with selective (+7%), 20.3 with selective + SP (+4%); Figure 8, the
# 530B and 1T layers: full recomputation +36%, selective + SP +2%; Table 5, end to end, the iteration
# seconds with full recomputation and with selective + SP: 22B 1.42 and 1.10 (+29.0% throughput),
# 175B 18.13 and 13.75 (+31.8%), 530B 49.05 and 37.83 (+29.7%), 1T 94.42 and 71.49 (+32.1%). The
# abstract's 530B runs scale Table 3's to 8-way data parallelism (2240 GPUs). Before Table 3's batches
# and interleaving were read, the 22B ran 8 micro-batches of one sequence and every model plain 1F1B.
# Table 4 and Figure 8 time one layer, so the lens's layer is timed alone against them
# (:func:`korthikanti_layer_seconds`); Table 5 and the abstract against whole steps.
K530 = (128, 20480, 105, 8, 35, 2240, 2240)
K530_MFU = {"selective + sequence parallel": 0.542, "full recompute": 0.421}
#: Table 3: (heads, hidden, layers, t, p, GPUs, global batch), then micro-batch size and chunks a rank
KORTHIKANTI_TABLE_3 = {"22B": ((64, 6144, 48, 8, 1, 8, 4), 4, 1), "175B": ((96, 12288, 96, 8, 8, 64, 64), 1, 3),
                       "530B": ((128, 20480, 105, 8, 35, 280, 280), 1, 3),
                       "1T": ((160, 25600, 128, 8, 64, 512, 512), 1, 1)}
#: Table 5: throughput of selective + SP over full recomputation without SP, less one
KORTHIKANTI_TABLE_5 = {"22B": 0.290, "175B": 0.318, "530B": 0.297, "1T": 0.321}
#: Table 5: iteration seconds, full recomputation (without SP) and selective + SP
KORTHIKANTI_SECONDS = {("22B", "full"): 1.42, ("22B", "selective + sequence parallel"): 1.10,
                       ("175B", "full"): 18.13, ("175B", "selective + sequence parallel"): 13.75,
                       ("530B", "full"): 49.05, ("530B", "selective + sequence parallel"): 37.83,
                       ("1T", "full"): 94.42, ("1T", "selective + sequence parallel"): 71.49}
#: (model, run): time over no recomputation without SP, less one (Table 4: 22B; Figure 8: 530B, 1T)
KORTHIKANTI_OVERHEADS = {("22B", "sequence parallel"): -0.03, ("22B", "full"): 0.39, ("22B", "selective"): 0.07,
                         ("22B", "selective + sequence parallel"): 0.04, ("530B", "full"): 0.36,
                         ("530B", "selective + sequence parallel"): 0.02, ("1T", "full"): 0.36,
                         ("1T", "selective + sequence parallel"): 0.02}
KORTHIKANTI_RUNS = {"none": ("none", False), "sequence parallel": ("none", True), "full": ("full", False),
                    "selective": ("selective", False), "selective + sequence parallel": ("selective", True)}


def korthikanti_steps() -> dict[str, StepTime]:
    """The 530B step as the abstract's two runs and without recomputation, by the lens."""
    chunks = KORTHIKANTI_TABLE_3["530B"][2]
    return {"selective + sequence parallel": megatron_step(*K530, checkpointing="selective", virtual_stages=chunks),
            "full recompute": megatron_step(*K530, checkpointing="full", sequence_parallel=False,
                                            virtual_stages=chunks),
            "none + sequence parallel": megatron_step(*K530, checkpointing="none", virtual_stages=chunks)}


def korthikanti_seconds(model: str, run: str) -> float:
    """The lens's step seconds of one Table 3 model under one of :data:`KORTHIKANTI_RUNS`."""
    checkpointing, sp = KORTHIKANTI_RUNS[run]
    setup, micro_batch, chunks = KORTHIKANTI_TABLE_3[model]
    return megatron_step(*setup, checkpointing=checkpointing, sequence_parallel=sp, micro_batch=micro_batch,
                         virtual_stages=chunks).seconds


def korthikanti_layer_seconds(model: str, run: str) -> float:
    """The lens's seconds of one layer of a Table 3 model in a step, as Table 4 and Figure 8 time a
    layer: the step's compute, recompute, elementwise and communication less those of the same model
    one layer shorter (so the head, the loss, the optimizer, the engine and the bubble drop out)."""
    checkpointing, sp = KORTHIKANTI_RUNS[run]
    (heads, hidden, layers, *rest), micro_batch, chunks = KORTHIKANTI_TABLE_3[model]

    def work(n: int) -> float:
        t = megatron_step(heads, hidden, n, *rest, checkpointing=checkpointing, sequence_parallel=sp,
                          micro_batch=micro_batch, virtual_stages=chunks).by_part
        return t.compute + t.recompute + t.elementwise + t.communication
    return work(layers) - work(layers - 1)


@pytest.fixture(scope="module")
def k530():
    return korthikanti_steps()


@pytest.mark.parametrize("run", list(K530_MFU))
def test_korthikanti_530b_mfu_within_25_percent(k530, run):
    """The lens's MFU (model FLOPs, no recompute) of each of the abstract's two runs."""
    assert 0.75 <= k530[run].mfu / K530_MFU[run] <= 1.25, (k530[run].mfu, K530_MFU[run])


def test_korthikanti_selective_removes_over_90_percent_of_the_overhead(k530):
    """Selective + SP's time over no recomputation is under a tenth of full recompute's."""
    none = k530["none + sequence parallel"].seconds
    selective = k530["selective + sequence parallel"].seconds - none
    full = k530["full recompute"].seconds - none
    assert 0 < selective < 0.1 * full, (selective, full)


def test_korthikanti_full_over_selective_overhead_within_5_points(k530):
    """The abstract's two MFUs: full recompute 28.7% slower than selective + SP (54.2 / 42.1)."""
    predicted = k530["full recompute"].seconds / k530["selective + sequence parallel"].seconds - 1
    published = K530_MFU["selective + sequence parallel"] / K530_MFU["full recompute"] - 1
    assert abs(predicted - published) <= 0.05, (predicted, published)


@pytest.mark.parametrize("model", list(KORTHIKANTI_TABLE_5))
def test_korthikanti_table_5_within_5_points(model):
    """End to end: selective + SP's throughput over full recomputation's, less one."""
    predicted = korthikanti_seconds(model, "full") / korthikanti_seconds(model, "selective + sequence parallel") - 1
    assert abs(predicted - KORTHIKANTI_TABLE_5[model]) <= 0.05, (predicted, KORTHIKANTI_TABLE_5[model])


@pytest.mark.parametrize("key", list(KORTHIKANTI_SECONDS), ids=[f"{m}-{r}" for m, r in KORTHIKANTI_SECONDS])
def test_korthikanti_table_5_seconds_within_25_percent(key):
    """Table 5's iteration seconds, predicted over published."""
    predicted = korthikanti_seconds(*key)
    assert 0.75 <= predicted / KORTHIKANTI_SECONDS[key] <= 1.25, (predicted, KORTHIKANTI_SECONDS[key])


@pytest.mark.parametrize("key", list(KORTHIKANTI_OVERHEADS), ids=[f"{m}-{r}" for m, r in KORTHIKANTI_OVERHEADS])
def test_korthikanti_overheads_within_5_points(key):
    """Table 4 and Figure 8: one layer's time in each run over no recomputation without SP, less one,
    the layer timed alone as the paper times it (before, the lens's whole steps, head, optimizer and
    engine included, stood against these per-layer figures: the 22B's full recomputation came out
    32.1% against 39%, a strict xfail; per layer it is 36.8%)."""
    model, run = key
    predicted = korthikanti_layer_seconds(model, run) / korthikanti_layer_seconds(model, "none") - 1
    assert abs(predicted - KORTHIKANTI_OVERHEADS[key]) <= 0.05, (predicted, KORTHIKANTI_OVERHEADS[key])


#: Table 4: one 22B layer's forward + backward, milliseconds (one micro-batch of 4 sequences)
KORTHIKANTI_TABLE_4_MS = {"none": 19.6, "sequence parallel": 19.0, "full": 27.2, "selective": 20.9,
                          "selective + sequence parallel": 20.3}


@pytest.mark.parametrize("run", list(KORTHIKANTI_TABLE_4_MS))
def test_korthikanti_table_4_layer_time_within_25_percent(run):
    """Table 4's milliseconds of one 22B layer, predicted over published."""
    predicted = korthikanti_layer_seconds("22B", run) * 1e3
    assert 0.75 <= predicted / KORTHIKANTI_TABLE_4_MS[run] <= 1.25, (predicted, KORTHIKANTI_TABLE_4_MS[run])


def test_megatron_recompute_reruns_both_tp_all_reduces():
    """Megatron-LM's full recomputation re-runs each layer's whole forward (``tensor_parallel.checkpoint``
    of whole layers, ``ParallelTransformer._checkpointed_forward``): six TP all-reduces a layer per
    micro-batch, where torch's non-reentrant checkpoint, which stops before the MLP's last matmul, runs
    five; without recomputation four. One all-reduce of ``b s h`` 16-bit elements per layer has each of
    the 4 ranks send 2 (4 - 1) / 4 of it (a ring)."""
    from memlab.time.communication import step_communication
    cfg = GPTConfig(name="g", n_layer=3, n_head=4, d_model=256, vocab_size=1024, block_size=128)
    step = StepConfig(model=cfg, seq=128, batch=4, micro_batches=2, precision="bf16", world_size=4,
                      checkpointing="full")
    one = 3 * 128 * 4 * 256 * 2 * 2 * 3 / 4  # layers x tokens x width x bf16 x the ring's share

    def tp(s, whole):
        return step_communication(replace(s, parallel=ParallelDims(tensor=4)), whole_forward_recompute=whole).by_kind[
            "tensor-parallel all-reduces"]
    assert tp(step, True) == 6 * one and tp(step, False) == 5 * one
    assert tp(replace(step, checkpointing="none"), True) == 4 * one


def test_sequence_parallel_shards_the_residual_stream_ops_only():
    """Without SP each TP rank runs the ops over the d-wide residual stream whole (norms,
    residual adds: t times their bytes), while the MLP's and attention's stay split: widening
    the MLP adds nothing to what SP saves; with t=1 the flag changes nothing."""
    from memlab.time.elementwise import step_elementwise
    cfg = GPTConfig(name="g", n_layer=2, n_head=4, d_model=256, vocab_size=1024, block_size=128)
    step = StepConfig(model=cfg, seq=128, batch=4, micro_batches=2, precision="bf16", world_size=4)
    ew = step_elementwise(step, "cuda")
    tp4 = replace(step, parallel=ParallelDims(tensor=4))
    on = step_time(tp4, "A100-80GB").by_part.elementwise
    off = step_time(tp4, "A100-80GB", sequence_parallel=False).by_part.elementwise
    assert 0 < ew.residual < ew.forward + ew.backward
    assert off / on == pytest.approx((ew.forward + ew.backward + 3 * ew.residual) / (ew.forward + ew.backward))
    wide = step_elementwise(replace(step, model=replace(cfg, mlp_hidden=4 * cfg.d_model * 2)), "cuda")
    assert wide.residual == ew.residual and wide.forward + wide.backward > ew.forward + ew.backward
    single = replace(step, world_size=1)
    assert step_time(single, "A100-80GB", sequence_parallel=False).seconds == \
        pytest.approx(step_time(single, "A100-80GB").seconds)


# Dubey et al. 2024 ("The Llama 3 Herd of Models", arXiv 2407.21783v3), sec. 3.3.2, Table 4 ("Scaling
# configurations and MFU for each stage of Llama 3 405B pre-training"), read in a full-text copy of the
# paper (find_string id 34692787445, its "[p. 10]" Table 4 and "[p. 11]" pipeline paragraph): BF16 on
# H100s, TP 8, CP 1, PP 16, sequence 8192, 16M tokens a batch; DP 64 with 32 sequences per DP group:
# 430 TFLOP/s per GPU (43% MFU) on 8,192 GPUs; DP 128 with 16: 400 (41%) on 16,384. MFU is that over
# the H100's dense BF16 peak (989.5 TFLOP/s). The third row (CP 16 at sequence 131,072) is left out:
# the lens has no context parallelism. The shapes are the paper's Table 3 (126 layers, width 16384,
# FFN 53248, 128 heads, 8 key/value heads, vocabulary 128,256). From sec. 3.3.2's text: "an interleaved
# schedule (Narayanan et al., 2021) with V pipeline stages on one pipeline rank ... Overall pipeline
# bubble ratio is (PP - 1) / (V * M)"; "one Transformer layer is reduced each from the first and the
# last stages ... the first model chunk on the first stage has only the embedding": a chunk is one
# layer, so 126 + 2 layer slots over 16 ranks is V = 8 chunks a rank (read off the text, not fitted);
# and "pre-trained on sequences of 8K tokens without activation checkpointing". Set, not read: one
# sequence per micro-batch (M = the sequences per DP group); FSDP timed as data parallelism with one
# gradient all-reduce a step. Before V was read (plain 1F1B's (p - 1)/M): 391 and 299 TFLOP/s.
LLAMA3_TABLE_4 = ((8192, 430), (16384, 400))
LLAMA3_VIRTUAL_STAGES = (126 + 2) // 16


def llama3_405b_tflops(gpus: int, virtual_stages: int = LLAMA3_VIRTUAL_STAGES) -> float:
    """The lens's model TFLOP/s per GPU of the 405B run on ``gpus`` H100s."""
    import json
    from importlib import resources

    hf = json.loads((resources.files("memlab") / "data" / "hf_configs" / "llama-3.1-70b.json").read_text())
    hf.update(num_hidden_layers=126, hidden_size=16384, intermediate_size=53248, num_attention_heads=128,
              num_key_value_heads=8, vocab_size=128256)
    tp, pp, seq = 8, 16, 8192
    per_replica = 16 * 2**20 // seq // (gpus // (tp * pp))
    step = StepConfig(model=gpt_config(hf, seq=seq), seq=seq, batch=per_replica, micro_batches=per_replica,
                      precision="bf16", world_size=gpus, checkpointing="none")
    t = step_time(replace(step, parallel=ParallelDims(tensor=tp, pipeline=pp)), "H100-80GB", gradient_sync="step",
                  virtual_stages=virtual_stages)
    return t.mfu * 989.5


@pytest.mark.parametrize("gpus, published", LLAMA3_TABLE_4, ids=["8192-gpus", "16384-gpus"])
def test_llama3_405b_within_25_percent(gpus, published):
    predicted = llama3_405b_tflops(gpus)
    assert 0.75 <= predicted / published <= 1.25, (predicted, published)


def test_llama3_halving_the_batch_per_dp_group_costs_what_the_paper_says():
    """Sec. 3.3.2: the drop from 43% to 41% MFU at 16K GPUs "is due to the lower batch size per DP
    group": the lens's 16K over 8K is within 3 points of 400 / 430, and only through the bubble
    (p - 1) / (V M): with V = 1 it drops by a third."""
    eight, sixteen = llama3_405b_tflops(8192), llama3_405b_tflops(16384)
    assert abs(sixteen / eight - 400 / 430) <= 0.03, (sixteen / eight, 400 / 430)
    assert llama3_405b_tflops(16384, virtual_stages=1) / llama3_405b_tflops(8192, virtual_stages=1) < 0.8


def test_interleaved_schedule_divides_the_bubble_and_multiplies_the_sends():
    """Narayanan et al. 2021, sec. 2.2.2: v chunks a rank cut the bubble to (p - 1) / (v m) of a
    stage's work and send v times the activations; v = 0 is bad input naming the value."""
    from memlab.core.errors import InputError
    step = StepConfig(model="gpt2-large", seq=1024, batch=8, micro_batches=8, precision="bf16", world_size=4)
    step = replace(step, parallel=ParallelDims(pipeline=4))
    plain = step_time(step, "H100-80GB")
    inter = step_time(step, "H100-80GB", virtual_stages=3)
    work = inter.by_part.compute + inter.by_part.recompute + inter.by_part.elementwise
    assert inter.by_part.bubble == pytest.approx(3 / (3 * 8) * work)
    sends = "pipeline activations and their gradients"
    assert inter.communication.by_kind[sends] == pytest.approx(3 * plain.communication.by_kind[sends], rel=1e-6)
    with pytest.raises(InputError, match="virtual_stages"):
        step_time(step, "H100-80GB", virtual_stages=0)


# torchtune's README ("Memory and training speed", table added in pytorch/torchtune@30b8519e86d2
# 094879576e16ab1f8d21a6f6f9f7, 2024-09-24, unchanged at bd2a0fc7): Llama 3.1 8B on one RTX 4090,
# batch 2 without gradient accumulation, a dataset packed to 2048 tokens, torch.compile on: LoRA
# 3,083 and QLoRA 2,413 tokens/s. The recipes at that commit differ in more than the base:
# recipes/configs/llama3_1/8B_lora_single_device.yaml adapts q_proj and v_proj only (rank 8, no
# MLP), 8B_qlora_single_device.yaml q, k, v, output and the MLP (rank 8, not the head); both bf16,
# activation checkpointing on, fused AdamW over the adapters. QLoRA's base is torchao's NF4Tensor
# (torchtune/modules/peft/lora.py: ``linear_nf4``), dequantised whole for each matmul and fused by
# torch.compile (memlab.time.step_time.dequant_nf4_torchao).
TORCHTUNE_4090 = {"lora": 3083, "qlora": 2413}
TT_QLORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TT_LORA_TARGETS = ("q_proj", "v_proj")


def torchtune_4090(qlora: bool, targets: tuple[str, ...] | None = None, dequant: str = "torchao-compiled") -> StepTime:
    """The lens's step of torchtune's Llama 3.1 8B LoRA (or QLoRA) recipe on one RTX 4090 (``dequant``:
    whose kernels dequantise the 4-bit base; torchtune's is torchao's NF4Tensor under torch.compile)."""
    targets = targets or (TT_QLORA_TARGETS if qlora else TT_LORA_TARGETS)
    from memlab.time.flops import lora_matmuls
    from memlab.time.step_time import Calibration, optimizer_pass
    cfg = gpt_config(str(pathlib.Path(__file__).parents[1] / "memlab/data/hf_configs/llama-3.1-8b.json"), seq=2048)
    step = StepConfig(model=cfg, seq=2048, batch=2, micro_batches=1, precision="pure-bf16", checkpointing="full")
    flops = gpt_step_flops(cfg, 2048, 2, checkpointing="full", lora_rank=8, lora_targets=targets)
    tuned = lora_matmuls(cfg, targets)
    adam = optimizer_pass("adamw", cfg.n_layer * sum(8 * (i + o) for _, i, o in tuned), 2 * len(tuned) * cfg.n_layer)
    return step_time(step, "RTX4090-24GB", flops=flops, optimizer=adam, calibration=Calibration("none", {}, 1.0),
                     lora_rank=8, lora_targets=targets, qlora=qlora, dequant=dequant)


@pytest.fixture(scope="module")
def tt4090():
    return {"lora": torchtune_4090(False), "qlora": torchtune_4090(True)}


@pytest.mark.parametrize("recipe", list(TORCHTUNE_4090))
def test_torchtune_4090_tokens_per_second_within_25_percent(tt4090, recipe):
    predicted = tt4090[recipe].tokens_per_second
    assert 0.75 <= predicted / TORCHTUNE_4090[recipe] <= 1.25, (predicted, TORCHTUNE_4090[recipe])


def test_qlora_slower_than_lora_by_the_counted_dequantisation(tt4090):
    """Over a LoRA step with QLoRA's seven adapters, QLoRA's extra seconds are torchao's fused
    dequantisation at the 4090's 1008 GB/s: per element the packed half byte, an int8 scaler per
    64, a bf16 factor per 64 x 256 read, the bf16 weight written; each tuned weight dequantised
    forward, backward and on recompute (not the last matmul's). The rest of QLoRA's lag behind
    torchtune's LoRA row is its five more adapters a layer."""
    cfg_i_o = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]
    uses = [3, 3, 3, 3, 3, 3, 2]  # Llama 3.1 8B's block; down_proj is not recomputed
    per_element = 0.5 + 1 / 64 + 2 / (64 * 256) + 2
    expected = 32 * sum(u * i * o * per_element for (i, o), u in zip(cfg_i_o, uses, strict=True)) / 1008e9
    same_adapters = torchtune_4090(False, TT_QLORA_TARGETS)
    assert tt4090["qlora"].seconds - same_adapters.seconds == pytest.approx(expected, rel=1e-6)
    assert tt4090["qlora"].tokens_per_second < same_adapters.tokens_per_second < tt4090["lora"].tokens_per_second


def test_qlora_on_bitsandbytes_kernels_slower_by_their_counted_bytes(tt4090):
    """The same recipe with bitsandbytes' 4-bit kernels (peft's QLoRA; bitsandbytes@37d2a938): each
    dequantisation runs three kernels (the 8-bit absmax to fp32, ``+ offset``, the 4-bit weight to bf16)
    moving, per weight element, the packed half byte, the 8-bit absmax per 64 and its fp32 scale per
    64 x 256, the fp32 absmax written, read and written by ``+ offset`` and read again (16 bytes per
    64), and the bf16 weight written; forward, backward and on recompute (not the last matmul). Its
    extra seconds over LoRA with the same adapters are those bytes at 1008 GB/s, launches hidden."""
    cfg_i_o = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]
    uses = [3, 3, 3, 3, 3, 3, 2]
    per_element = 0.5 + (1 + 4 / 256 + 4 + 8 + 4) / 64 + 2
    expected = 32 * sum(u * i * o * per_element for (i, o), u in zip(cfg_i_o, uses, strict=True)) / 1008e9
    bnb = torchtune_4090(True, dequant="bitsandbytes")
    same_adapters = torchtune_4090(False, TT_QLORA_TARGETS)
    assert bnb.seconds - same_adapters.seconds == pytest.approx(expected, rel=1e-6)
    assert bnb.seconds > tt4090["qlora"].seconds  # its absmax passes move more than torchao's fused kernel


def test_qlora_slowdown_against_torchtune_within_10_points(tt4090):
    """torchtune's QLoRA row is 21.7% below its LoRA row in tokens/s (2413 / 3083); the lens's
    counted dequantisation and adapters put it within 10 points of that."""
    published = 1 - TORCHTUNE_4090["qlora"] / TORCHTUNE_4090["lora"]
    predicted = 1 - tt4090["qlora"].tokens_per_second / tt4090["lora"].tokens_per_second
    assert abs(predicted - published) <= 0.10, (predicted, published)


def test_torchao_nf4_dequant_bytes_match_its_tensors_and_ops():
    """torchao's own NF4Tensor (torchao 0.18): fused, the bytes of the tensors it keeps read
    and the bf16 weight written; eager, every aten op ``get_original_weight`` dispatches,
    its inputs' distinct bytes read (an expanded view reads its storage) and outputs written."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    nf4 = pytest.importorskip("torchao.quantization")
    from memlab.time.step_time import dequant_nf4_torchao
    w = nf4.to_nf4(torch.randn(256, 512, dtype=torch.bfloat16))
    kept = sum(t.numel() * t.element_size() for t in (w.quantized_data, w.quantized_scalers, w.quantization_factor))
    fused = dequant_nf4_torchao(w.numel(), compiled=True)
    assert fused.bytes == pytest.approx(kept + 2 * w.numel()) and fused.launches == 1

    class Moved(TorchDispatchMode):
        bytes, ops = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and func is not torch.ops.aten._unsafe_view.default:  # views move nothing
                ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                self.bytes += sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) for t in ins)
                self.bytes += sum(t.numel() * t.element_size() for t in outs)
                self.ops += 1
            return out

    with Moved() as m:
        w.get_original_weight()
    eager = dequant_nf4_torchao(w.numel(), compiled=False)
    assert eager.bytes == pytest.approx(m.bytes, rel=1e-3) and eager.launches == m.ops  # 1e-3: the 16-entry table


def test_dequant_bytes_match_bitsandbytes_quant_state():
    """The bytes per dequantisation, from the tensors bitsandbytes itself keeps for an NF4 weight
    with double quantisation: the packed weight, the 8-bit absmax and its fp32 second level read,
    the fp32 absmax written, read and written by ``+ offset``, read by ``dequantize_4bit``, and
    the bf16 weight written."""
    import torch
    bnb = pytest.importorskip("bitsandbytes.functional")
    from memlab.time.step_time import dequant_4bit_bytes
    w = torch.randn(256, 512, dtype=torch.bfloat16)
    packed, state = bnb.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    blocks = state.absmax.numel()
    fp32_absmax = 4 * blocks
    expected = (packed.numel() * packed.element_size()
                + state.absmax.numel() * state.absmax.element_size()
                + state.state2.absmax.numel() * state.state2.absmax.element_size() + fp32_absmax  # dequantize_blockwise
                + 2 * fp32_absmax + fp32_absmax  # + offset; read by the 4-bit kernel
                + w.numel() * 2)
    assert dequant_4bit_bytes(w.numel()) == pytest.approx(expected)


def test_lora_adapter_gemms_are_bandwidth_bound():
    """A rank-8 adapter's GEMMs on a 4096-token micro-batch take their bytes' time, above what
    their FLOPs would at the large-GEMM rate: what the lens adds over the matmuls' rate."""
    from memlab.time.step_time import adapter_time
    cfg = gpt_config(str(pathlib.Path(__file__).parents[1] / "memlab/data/hf_configs/llama-3.1-8b.json"), seq=2048)
    a = adapter_time(cfg, 4096, 8, ("q_proj",), checkpointing="none", peak=165.2e12, achievable=0.8, hbm=1008e9)
    t, k, r = 4096, 4096, 8
    by_bytes = 2 * sum(m * kk + kk * n + m * n for m, kk, n in
                       ((t, k, r), (t, r, k), (r, t, k), (t, k, r), (k, t, r), (t, r, k))) / 1008e9
    assert a.seconds == pytest.approx(32 * by_bytes)
    assert a.seconds > 10 * a.flops / (0.8 * 165.2e12)


def test_adapter_bad_input_names_the_value():
    from memlab.core.errors import InputError
    from memlab.time.flops import lora_matmuls
    from memlab.time.step_time import adapter_time, dequant_4bit_bytes
    cfg = GPTConfig(name="g", n_layer=1, n_head=4, d_model=256, vocab_size=1024, block_size=128)
    with pytest.raises(InputError, match="rank=0"):
        adapter_time(cfg, 128, 0, ("c_attn",), checkpointing="none", peak=1e12, achievable=0.5, hbm=1e11)
    with pytest.raises(InputError, match="q_proj"):
        lora_matmuls(cfg, ("q_proj",))
    with pytest.raises(InputError, match="elements=0"):
        dequant_4bit_bytes(0)
