"""memlab.step.states: one model-state formula for every lens, in plain PyTorch's and DeepSpeed's
layouts."""
import pytest
import torch

from memlab.models.gpt_unet import UNET_PRESETS, build_model, get_config
from memlab.step.states import (
    bytes_per_param,
    model_state_bytes,
    model_states,
    param_numels,
    pinned_bytes,
    under_deepspeed,
    with_zero2_partition,
    zero2_partition_elements,
)
from memlab.step.zero import zero_formula

PSI = 10**9


@pytest.mark.parametrize("stage, gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_deepspeed_layout_reproduces_the_papers_figure_1(stage, gb):
    """Rajbhandari et al. 2020 (ZeRO), figure 1: a 7.5B-parameter model on 64 data-parallel
    ranks with mixed-precision Adam (K = 12) keeps 120, 31.4, 16.6 and 1.9 GB per device at
    stages 0-3 (the paper's rounding). DeepSpeed's bf16 layout without its buffers."""
    s = model_states(7_500_000_000, precision="bf16", zero=stage, world_size=64, deepspeed=True)
    assert (s.parameters + s.gradients + s.optimizer) / 1e9 == pytest.approx(gb, abs=0.05)


@pytest.mark.parametrize("name, published", [("gpt2-small", 124_439_808), ("mistral-7b", 7_241_732_096)])
def test_param_numels_are_the_tensors_the_model_builds(name, published):
    """The closed form, tensor by tensor (ZeRO-3's persistence threshold and the largest
    parameter read single tensors), against the model built on the meta device: GPT-2 small
    (tied embedding, learned positions, biases) and Mistral-7B (GQA, SwiGLU, untied head),
    whose totals are their published counts (Hugging Face ``num_parameters()``)."""
    cfg = get_config(name)
    with torch.device("meta"):
        built = sorted(p.numel() for p in build_model(cfg).parameters())
    assert sorted(param_numels(cfg)) == built
    assert sum(built) == published


@pytest.mark.parametrize("preset, hf_name", [("gpt2-small", "gpt2"), ("mistral-7b", "mistral-7b")])
def test_memlabs_gpt_and_a_hugging_face_config_are_one_shape_type(preset, hf_name):
    """Issue 36: one model description. memlab's GPT-2 small and Mistral-7B presets, as shapes
    (``GPTConfig.shape``), count the parameters the shipped Hugging Face configs' shapes count
    (:func:`memlab.hf.shape.decoder_shape`), tensor for tensor up to memlab's fused q/k/v (GPT-2
    fuses it too), and a shape of memlab's GPT is refused as a decoder's run (its class is memlab's)."""
    from memlab.core.errors import InputError
    from memlab.hf.shape import decoder_shape
    from memlab.models.decoder_shape import MEMLAB_GPT
    from memlab.step.training_step import StepConfig

    mine, theirs = get_config(preset).shape, decoder_shape(hf_name)
    assert mine.model_type == MEMLAB_GPT and mine.num_params() == theirs.num_params()
    if preset == "gpt2-small":
        assert sorted(mine.param_numels()) == sorted(theirs.param_numels())
    with pytest.raises(InputError, match="GPTConfig"):
        StepConfig(mine)


def test_param_numels_of_the_unet_are_its_parameters():
    cfg = get_config(next(iter(UNET_PRESETS)))
    assert sorted(param_numels(cfg)) == sorted(p.numel() for p in build_model(cfg).parameters())


#: Rajbhandari et al. 2020 (ZeRO), sec. 5.1 and figure 1, bytes per parameter on one of N_d ranks:
#: 2 (fp16 parameters) + 2 (fp16 gradients) + K = 12 (fp32 master, momentum, variance);
#: P_os divides the 12, P_os+g also the gradients' 2, P_os+g+p also the parameters' 2.
PAPER = {0: lambda n: (2, 2, 12), 1: lambda n: (2, 2, 12 / n), 2: lambda n: (2, 2 / n, 12 / n),
         3: lambda n: (2 / n, 2 / n, 12 / n)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_deepspeed_bf16_is_the_papers_2_2_12(stage, n):
    """DeepSpeed's bf16 layout and the paper's formula, each against the paper's literal bytes."""
    want = dict(zip(("parameters", "gradients", "optimizer"), PAPER[stage](n), strict=True))
    assert bytes_per_param("bf16", stage, n) == pytest.approx(want, rel=1e-12)
    assert zero_formula(1, stage, n) == pytest.approx(want, rel=1e-12)


def test_deepspeed_fp32_keeps_a_master_copy_from_stage_1():
    """The CPU measurement of DeepSpeed fp32 on 2 ranks (tiny: 14.26 MiB of fp32 weights):
    stage 0 optimizer 28.51 MiB (two moments, no master); stage 1 master 7.13 + moments
    14.26 MiB per rank."""
    assert bytes_per_param("fp32", 0, 2) == {"parameters": 4, "gradients": 4, "optimizer": 8}
    mib_per_byte = 14.26 / 4  # MiB of the tiny model per byte per parameter
    assert bytes_per_param("fp32", 1, 2)["optimizer"] * mib_per_byte == pytest.approx(7.13 + 14.26, rel=1e-3)
    assert bytes_per_param("fp32", 3, 2) == {"parameters": 2, "gradients": 2, "optimizer": 6}


def test_plain_pytorch_autocast_keeps_fp32_weights():
    s = model_state_bytes(PSI, precision="bf16")
    assert (s["parameters"], s["gradients"], s["optimizer"], s["host"]) == (4 * PSI, 4 * PSI, 8 * PSI, 0)
    pure = model_state_bytes(PSI, precision="pure-bf16", optimizer="sgd")
    assert (pure["parameters"], pure["optimizer"]) == (2 * PSI, 2 * PSI)
    assert not under_deepspeed(0, "none") and under_deepspeed(1) and under_deepspeed(2, "optimizer")


def test_offload_moves_master_moments_and_gradients_to_the_host():
    """ZeRO-Offload (Ren et al. 2021, sec. 4.1): fp32 master, moments and gradients on the
    host; the device keeps the 16-bit parameters (and, stage 3 + parameter offload, only the
    small persistent ones)."""
    cfg = get_config("gpt2-large")
    psi = cfg.num_params()
    off = model_states(cfg, precision="bf16", zero=2, offload="optimizer", pinned=False)
    assert off.optimizer == 0 and off.gradients == 0 and off.parameters == 2 * psi
    assert off.host["optimizer"] == 12 * psi and off.host["parameters"] == 2 * psi
    largest = get_config("gpt2-large").vocab_size * cfg.d_model  # the tied embedding
    assert off.host["gradients"] == 4 * psi + 4 * largest
    inf = model_states(cfg, precision="bf16", zero=3, offload="all", pinned=False)
    small = sum(p for p in param_numels(cfg) if p < 10_000)  # biases and norms
    assert inf.parameters == 2 * small and inf.host["parameters"] == 2 * psi
    assert inf.gathered == 2 * (largest + 2**20)
    pinned = model_states(cfg, precision="bf16", zero=2, offload="optimizer")
    assert pinned.host["gradients"] == pinned_bytes(4 * psi) + pinned_bytes(4 * largest)


def test_pinned_host_blocks_are_powers_of_two():
    assert [pinned_bytes(b) for b in (0, 1, 3, 4096, 4097, 3 * 2**30)] == \
        [0, 1, 4, 4096, 8192, 4 * 2**30]


@pytest.mark.parametrize("kw, needle", [
    (dict(zero=0, offload="optimizer"), "offload='optimizer' needs ZeRO stage 1-3"),
    (dict(zero=2, offload="all"), "offload='all' (parameters too) needs ZeRO stage 3"),
    (dict(zero=4), "ZeRO stage 4 is outside 0-3"),
    (dict(precision="fp8"), "precision='fp8'; allowed"),
    (dict(optimizer="lion"), "optimizer='lion'; allowed"),
    (dict(world_size=0), "world size 0 must be a positive integer"),
])
def test_bad_input_names_the_value(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        model_states(PSI, **kw)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_zero3_steps_one_sub_group_at_a_time(ranks):
    """Stage 3's step converts one sub-group's gradients to fp32 at a time: DeepSpeed groups
    the rank's parameter partitions in order until a group holds sub_group_size (1e9) elements
    (stage3.py, _create_fp16_sub_groups). That grouping, run on Llama-3.1-8B's tensors, gives
    the largest group; the scratch is its fp32 bytes, bounded above by sub_group + the largest
    partition (what memlab counts), and the whole partition's below 1e9 elements a rank."""
    import math

    from memlab.hf.shape import decoder_shape
    from memlab.step.states import SUB_GROUP_SIZE, model_states
    s = decoder_shape("llama-3.1-8b")
    groups, size = [], 0
    for n in s.param_numels():
        size += math.ceil(n / ranks)
        if size >= SUB_GROUP_SIZE:
            groups.append(size)
            size = 0
    groups.append(size)
    scratch = model_states(s, precision="bf16", zero=3, world_size=ranks).step_scratch
    assert 4 * max(groups) <= scratch * (1 + 1e-6)
    assert scratch <= 4 * max(groups) * 1.25
    if s.num_params() / ranks <= SUB_GROUP_SIZE:
        assert scratch == pytest.approx(4 * s.num_params() / ranks)


def test_zero2_partition_is_deepspeeds_params_in_partition_whole():
    """Each rank's ZeRO-2 gradient partition is the parameters DeepSpeed's own ``get_partition_info``
    (0.19.8 stage_1_and_2.py 2579-2611, run here on meta tensors) puts in ``params_in_partition``,
    whole; the share is the flat group padded to 2 x ranks (lines 441-446), over the ranks (586).
    On the Llama config of tests/test_hf_zero.py, in its class's parameter order, real DeepSpeed
    on 2 gloo ranks allocated 229,632 and 213,376 elements (measured: sum of params_in_partition)."""
    import random
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    rng = random.Random(0)
    for _ in range(40):
        sizes = [rng.choice([0, 1, 7, 64, 4096, 10_000]) for _ in range(rng.randint(1, 12))]
        n = rng.randint(1, 5)
        if not sum(sizes):
            continue
        share = -(-sum(sizes) // (2 * n)) * 2 * n // n
        metas = [torch.empty(k, device="meta") for k in sizes]
        theirs = [sum(t.numel() for t in DeepSpeedZeroOptimizer.get_partition_info(None, metas, share, r)[0])
                  for r in range(n)]
        assert zero2_partition_elements(sizes, n) == theirs, (sizes, n)
    pytest.importorskip("transformers")
    from test_hf_lora import CONFIGS

    from memlab.hf.simulate import build_run, trainable_numels
    sizes = trainable_numels(build_run(CONFIGS["llama"]))
    assert zero2_partition_elements(sizes, 2) == [229_632, 213_376]
    ms = model_states(sum(sizes), zero=2, world_size=2)
    assert ms.gradients == 4 * sum(sizes) / 2  # the paper's even share, 65,280 B under rank 0's
    assert with_zero2_partition(ms, sizes, 2).gradients == 4 * 229_632
    assert with_zero2_partition(ms, sizes, 2, rank=1).gradients == 4 * 213_376
    z3 = model_states(sum(sizes), zero=3, world_size=2)
    assert with_zero2_partition(z3, sizes, 2) == z3  # stage 3's partition is its own flat buffer
