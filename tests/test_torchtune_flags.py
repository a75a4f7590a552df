"""torchtune's README "Optimization flags" table against the simulation (issue 39).

Source: pytorch/torchtune README.md at 1814feb17 (the commit that added the table, "add flags to
readme (#2003)"): Llama 3.2 3B, ``full_finetune_single_device``, batch 2, max sequence length 4096
(the rows from "+ Packed Dataset" on pack every sample to 4096 tokens), bf16, one A100; each row
adds one technique to the one above. The statistic is "Peak Memory Active (GiB)":
``torch.cuda.memory_stats()["active_bytes.all.peak"]`` (torchtune/training/memory.py:267 at the
same commit), the bytes of blocks handed out at the worst moment, the allocator's 512-byte
rounding included and its cached free blocks not: what ``simulate_step`` counts on a CUDA
target (``peak_bytes``), so the two are compared as they stand.

What memlab expresses of each row: packing (a full 2 x 4096 batch), bf16 weights and AdamW
state (``pure-bf16``: torchtune's ``dtype: bf16`` builds the model in bf16 and AdamW keeps its
moments in the parameters' dtype), activation checkpointing (``full``: torchtune wraps every
decoder layer), the optimizer step in backward, activation offloading.

"+ Packed Dataset" (60.0 GiB, eager) runs torchtune's decoder, which saves more than memlab's
GPT did (48.6 GiB, -19%); two switches of :class:`~memlab.models.gpt_unet.GPTConfig` say what
(tests/test_torchtune_switches.py checks each against measured steps):

* ``norm_fp32``: torchtune's RMSNorm is Python in fp32 (torchtune/modules/rms_norm.py:61-65 at
  1814feb17): it keeps the fp32 upcast of its input and the cast-back normalised input, 4 bytes
  per element more than ``F.rms_norm``'s fused CUDA kernel (its input and rstd); 57 norms of
  2 x 4096 x 3072: +5.35 GiB.
* ``logits_fp32``: its tied decoder returns ``F.linear(h, tok_embeddings.weight).float()``
  (torchtune/modules/transformer.py:937), so the recipe's ``nn.CrossEntropyLoss`` runs in fp32:
  at the log-softmax's backward its saved output and the gradient in and out are 12 bytes per
  logit against 6, on 8192 x 128256 logits: +5.87 GiB.

Not differences: the fp32 RoPE (``xshaped = x.float()``, torchtune/models/llama3_1/
_position_embeddings.py:171) saves nothing (its products save only the rotary cache, which needs
no gradient; the fp32 copies are freed within the call), and the block-causal flex attention of
packed samples (torchtune/modules/attention_utils.py) saves q, k, v, the output and a log-sum-exp,
as SDPA's flash kernel does; k and v are expanded to every query head (``expand().flatten()``
copies, torchtune/modules/attention.py:288-290), as memlab's ``gqa="repeat"``.

"+ Compile" (51.0 GiB) compiles as torchtune does: each decoder layer and the loss apart
(torchtune/training/_compile.py:51-55 and :81 at 1814feb17), the head and its ``.float()`` eager
between them (``StepConfig(compile="layers")``, :func:`memlab.step.compiled.compile_layers`); the
simulation runs inductor's partition and generated wrapper per region: 47.1 GiB (-7.6%). Compiled
as one graph (``compile=True``) inductor fuses both switches and the loss away: 41.4 GiB (-18.8%).
"+ Chunked Cross Entropy" (42.9 GiB) adds torchtune's ``CEWithChunkedOutputLoss``
(``loss="chunked_output"``): every chunk's logits made in forward (``chunked_output``,
torchtune/modules/transformer.py:750-753), each chunk cast to fp32 in its own compiled loss
(torchtune/training/_compile.py:74-77): 42.96 GiB (+0.1%). memlab's own chunked loss (no logits
kept) is not torchtune's.

The rows from "+ Activation Checkpointing" on run the step torchtune ran: the compiled, chunked-loss
step above with every decoder layer checkpointed (``checkpointing="full"``), then the optimizer step in
backward, then activation offloading. torchtune compiles each layer first and then wraps it in a
non-reentrant ``checkpoint_wrapper`` (recipes/full_finetune_single_device.py:424-430 at 1814feb17), so the
checkpoint runs eager around each compiled layer, keeping only its input
(:class:`memlab.step.compiled.CheckpointedRegion`; tests/test_torchtune_compose.py checks each composition
against measured CPU steps). Simulated: 25.53 GiB (+2.6%; its peak after the layers' backward, every
gradient held and the tied embedding's two gradients in flight, 1.47 GiB), 23.25 GiB (+0.7%; no
gradient held, 1.49 GiB of activations at its peak: the 28 checkpointed inputs, 1.31), 22.02 GiB
(+1.0%; none left on the device at its peak). memlab's eager GPT with its bf16
loss stood in for them before: +2.5%, -8.0%, -5.4%. The offloaded row's host bytes are memlab's
``save_on_cpu`` count (every saved tensor, the head's weight once per chunk), not torchtune's
``OffloadActivations``, which skips parameters, tensors under 1 KiB, the output head and the loss.

"+ 8-bit AdamW" is simulated with bitsandbytes' ``AdamW8bit`` on the offloading row (``EIGHT_BIT_ADAMW``,
at the end of the file, says why not the paged one); the LoRA/QLoRA rows are not simulated here.
"""
from dataclasses import replace

import pytest

from memlab.lenses.estimate import estimate_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import GPTConfig
from memlab.step.low_bit import adam_state_bytes
from memlab.step.training_step import StepConfig

GiB = 2**30

#: Llama 3.2 3B as torchtune builds it (torchtune/models/llama3_2/_model_builders.py:39-58 at
#: 1814feb17): vocab 128256, 28 layers, 24 heads, 8 kv heads, 3072 wide, 8192 MLP, rope base
#: 500000; tied embeddings (``output_proj = TiedLinear(tok_embeddings)``, _component_builders.py:115
#: there). Rotary tables for 4096 positions, the longest sequence the table runs.
LLAMA_3_2_3B = GPTConfig(n_layer=28, n_head=24, n_kv_head=8, d_model=3072, mlp_hidden=8192, vocab_size=128256,
                         block_size=4096, mlp="swiglu", norm="rmsnorm", position="rope", bias=False,
                         tie_embeddings=True, rope_theta=500000.0, name="llama-3.2-3b")

#: The same model as torchtune's decoder saves for backward (the module doc)
TORCHTUNE_3B = replace(LLAMA_3_2_3B, norm_fp32=True, logits_fp32=True)

PACKED = dict(model=TORCHTUNE_3B, seq=4096, batch=2, precision="pure-bf16")
COMPILED = dict(PACKED, compile="layers")
CHUNKED_CE = dict(COMPILED, model=replace(TORCHTUNE_3B, logits_fp32=False, loss="chunked_output"))
#: the rows after it add to torchtune's compiled, chunked-loss step (see the module doc)
AC = dict(CHUNKED_CE, checkpointing="full")
IN_BWD = dict(AC, optimizer_in_backward=True)
OFFLOAD = dict(IN_BWD, activation_offload=True)

#: (row, published "Peak Memory Active" GiB, the step memlab runs for it)
ROWS = [("+ Activation Checkpointing", 24.9, AC),
        ("+ Fuse optimizer step into backward", 23.1, IN_BWD),
        ("+ Activation Offloading", 21.8, OFFLOAD)]


_SIMULATED: dict[tuple, int] = {}


def simulate(step: dict) -> int:
    """The simulated peak of ``step`` on an A100-80GB, each step once per session (25-35 s each)."""
    key = tuple(sorted((k, repr(v)) for k, v in step.items()))
    if key not in _SIMULATED:
        _SIMULATED[key] = simulate_step(StepConfig(**step), card="A100-80GB", target="cuda").peak_bytes
    return _SIMULATED[key]


def test_the_model_is_llama_3_2_3b():
    """3.21 B parameters: the hub's "Model size" for meta-llama/Llama-3.2-3B's safetensors."""
    assert round(LLAMA_3_2_3B.num_params() / 1e9, 2) == 3.21


@pytest.mark.slow
def test_the_checkpointed_row_by_the_estimate_within_5_percent():
    """The estimate of "+ Activation Checkpointing": it traces the compiled layers as the simulation runs
    them (minutes at this size), beside the formula's model states: +2.5% when written (memlab's eager
    GPT standing in for the row, a fast test then: +2.7%)."""
    est = estimate_step(StepConfig(**AC), card="A100-80GB", target="cuda")
    assert est.peak_bytes == pytest.approx(24.9 * GiB, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("row,published,step", ROWS, ids=[r[0] for r in ROWS])
def test_torchtune_optimization_flags_row_within_5_percent(row, published, step):
    """Measured on torchtune's run: within 5% (+2.6%, +0.7%, +1.0% when written, 2-3 minutes each on
    two cores; the issue asked for 10%; memlab's eager GPT standing in for them read +2.5%, -8.0%, -5.4%)."""
    assert simulate(step) == pytest.approx(published * GiB, rel=0.05), row


def test_the_packed_row_by_the_estimate_within_2_percent():
    """"+ Packed Dataset", 60.0 GiB, by the estimate (+5.35 GiB of fp32 norms and +5.87 of the
    fp32 loss on memlab's GPT's 48.6): -0.3% when written."""
    est = estimate_step(StepConfig(**PACKED), card="A100-80GB", target="cuda")
    assert est.peak_bytes == pytest.approx(60.0 * GiB, rel=0.02)


@pytest.mark.slow
def test_the_packed_row_without_checkpointing_within_2_percent():
    """torchtune's decoder, simulated: -0.3% when written (memlab's own GPT: -19%)."""
    assert simulate(PACKED) == pytest.approx(60.0 * GiB, rel=0.02)


@pytest.mark.slow
def test_the_compiled_row_within_10_percent():
    """"+ Compile", torchtune's layers and loss compiled apart: -7.6% when written (45 s on two
    cores: 28 layers partitioned and lowered one by one); one whole graph reads -18.8%."""
    assert simulate(COMPILED) == pytest.approx(51.0 * GiB, rel=0.10)


@pytest.mark.slow
def test_the_chunked_cross_entropy_row_within_2_percent():
    """"+ Chunked Cross Entropy", compiled as torchtune compiles it: +0.1% when written (about a
    minute on two cores)."""
    assert simulate(CHUNKED_CE) == pytest.approx(42.9 * GiB, rel=0.02)


@pytest.mark.slow
def test_each_flag_lowers_the_peak_as_the_table_orders_them():
    """The table's direction, row on row: checkpointing, then the step in backward, then
    offloading each lower the peak, below the packed, compiled and chunked-loss rows (torchtune:
    60.0 > 51.0 > 42.9 > 24.9 > 23.1 > 21.8)."""
    peaks = [simulate(step) for _, _, step in ROWS]
    assert peaks[0] > peaks[1] > peaks[2]
    assert simulate(PACKED) > simulate(COMPILED) > simulate(CHUNKED_CE) > peaks[0]


#: "+ 8-bit AdamW" (17.6 GiB): the offloading row with an 8-bit AdamW state on the device. The README
#: names the row's optimizer ``AdamW8bit`` ("LoRA and QLoRA ... do not use `optimizer_in_bwd` or `AdamW8bit`
#: optimizer"); its lesson (docs/source/tutorials/memory_optimizations.rst:162-197 at 1814feb17) offers
#: torchao's ``AdamW8bit`` and bitsandbytes' ``PagedAdamW8bit`` (the 3B recipe's default,
#: recipes/configs/llama3_2/3B_full_single_device.yaml). memlab runs bitsandbytes' ``AdamW8bit``
#: (torchao's keeps the same bytes: a uint8 code per element and an fp32 scale per 256-block). A paged
#: state's uint8 moments would be outside the caching allocator whose "active" peak the row reports (the
#: block maxima and the norms' state stay): simulated, 10.14 GiB (-42.4%); the published 4.2 GiB drop
#: from the row above is the 8-bit state's saving on the device (5.9 GiB of bf16 moments less its 6.1),
#: not the whole state's (12.0 GiB).
EIGHT_BIT_ADAMW = dict(OFFLOAD, optimizer="adamw-8bit")


@pytest.mark.slow
def test_the_8bit_adamw_row_within_10_percent():
    """"+ 8-bit AdamW", 17.6 GiB: on the compiled, chunked-loss offloading row, 16.14 GiB (-8.3%)
    when written (18.06, +2.6%, on the eager stand-in the row used before), the state 2.03 bytes a
    parameter on the device (bitsandbytes' own allocation on fake tensors). The row above less the
    state's saving: to 0.5%, since the two steps in backward peak at different moments (15 MB of
    6.3 GB apart when written; on the eager stand-in it was within 0.1%)."""
    assert simulate(EIGHT_BIT_ADAMW) == pytest.approx(17.6 * GiB, rel=0.10)
    assert simulate(OFFLOAD) - simulate(EIGHT_BIT_ADAMW) == pytest.approx(
        LLAMA_3_2_3B.num_params() * 4 - adam_state_bytes(LLAMA_3_2_3B.param_numels(), "adamw-8bit"), rel=0.005)
