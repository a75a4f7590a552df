"""LoRA through peft, HF's own checkpointing and 8-bit optimizer state, measured.

Expected numbers: what peft itself reports, 8 bytes per trainable parameter for fp32 AdamW,
memlab's own GPT with checkpointing="full", bitsandbytes' own state tensors (where it runs).
"""
import pytest
import torch

pytest.importorskip("peft")

from hf_gpt_mapping import gpt_config, step_config

from memlab import measure_step
from memlab.hf import config as hf
from memlab.hf.estimate import estimate_hf
from memlab.hf.simulate import simulate_hf
from memlab.lenses.your_model import track_step
from memlab.models.gpt_unet import GPT, PRESETS
from memlab.step import low_bit
from memlab.step.fine_tune_config import GPT2_TARGETS, LLAMA_TARGETS, LoraConfig
from memlab.techniques import finetune
from memlab.tracking.tracker import CATEGORIES

SMALL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
         "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 512,
         "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "vocab_size": 500,
        "n_positions": 256}
SEQ, BATCH = 128, 4
ACT, GRAD = CATEGORIES.index("activations"), CATEGORIES.index("gradients")


def _lora(targets, r=8):
    return dict(r=r, target_modules=list(targets), lora_alpha=2 * r, lora_dropout=0.0)


def _measure(cfg, precision="fp32", **kw):
    torch.manual_seed(0)
    model, opt = hf.build_fn(cfg, **kw)()
    step = hf.causal_lm_step(SEQ, BATCH, precision)
    return model, opt, track_step(lambda: step(model, opt), model=model, optimizer=opt)


@pytest.mark.parametrize("cfg,targets", [(SMALL, ["q_proj", "v_proj"]),
                                         (SMALL, LLAMA_TARGETS),
                                         (GPT2, GPT2_TARGETS)])
def test_lora_count_equals_peft(cfg, targets):
    torch.manual_seed(0)
    model, _ = hf.build_fn(cfg, lora=_lora(targets))()
    trainable, _ = model.get_nb_trainable_parameters()
    assert finetune.lora_params(gpt_config(cfg), 8, targets) == trainable


def test_lora_step_keeps_state_only_for_adapters():
    model, opt, report = _measure(SMALL, lora=_lora(["q_proj", "v_proj"]))
    trainable, _ = model.get_nb_trainable_parameters()
    tensors = [p for p in model.parameters() if p.requires_grad]
    # fp32 AdamW: two moments of 4 bytes per trainable parameter, plus the fused kernel's
    # fp32 step counter per tensor
    assert report.by_category["optimizer"] == 8 * trainable + 4 * len(tensors)
    assert max(e.by_category[GRAD] for e in report.timeline) == 4 * trainable
    n = sum(p.numel() for p in model.parameters())
    assert report.by_category["parameters"] == 4 * n  # the frozen model is still held


@pytest.mark.parametrize("targets,ckpt,precision,band", [
    (["q_proj", "v_proj"], None, "fp32", (0.0, 0.03)),
    # bf16 under HF's checkpointing: the estimate keeps 1.7 MB more temporaries than the step
    (["q_proj", "v_proj"], "full", "bf16", (0.08, 0.11)),
    (LLAMA_TARGETS, None, "bf16", (-0.07, -0.035)),
    (LLAMA_TARGETS, "full", "fp32", (0.01, 0.04))])
def test_lora_estimate_tracks_the_measured_step(targets, ckpt, precision, band):
    """The estimate against the real step tracked, each case within a band around its
    measured error (+1.5%, +9.7%, -5.3%, +2.8% here): a drift of 1.5% either way fails; the
    frozen weights byte for byte, the adapters' AdamW moments to the fused step's counters."""
    model, _, report = _measure(SMALL, precision, lora=_lora(targets), checkpointing=ckpt)
    est = finetune.estimate_lora(step_config(SMALL, seq=SEQ, batch=BATCH, checkpointing=ckpt,
                                                precision=precision), rank=8, targets=targets)
    error = est.peak_bytes / report.peak_bytes - 1
    assert band[0] <= error <= band[1], error
    assert est.by_category["parameters"] == report.by_category["parameters"]
    fused_steps = 4 * sum(p.requires_grad for p in model.parameters())  # one fp32 step count a tensor
    assert est.by_category["optimizer"] + fused_steps == report.by_category["optimizer"]


def test_lora_estimate_of_llama_3_8b_within_3_percent_of_simulate():
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    kw = dict(seq=2048, batch=1, precision="bf16", checkpointing="full")
    sim = simulate_hf("llama-3-8b", target="cuda", lora=LoraConfig(rank=16, targets=tuple(targets)), **kw)
    est = finetune.estimate_lora(step_config("llama-3-8b", **kw), rank=16, targets=targets,
                                 target="cuda")
    assert est.peak_bytes == pytest.approx(sim.peak_bytes, rel=0.03)
    assert sim.by_category["optimizer"] < 0.01 * sim.by_category["parameters"]


def test_lora_rejects_unknown_targets():
    with pytest.raises(ValueError, match="allowed: q_proj"):
        finetune.lora_params(gpt_config(SMALL), 8, ["qkv"])


def test_hf_checkpointing_keeps_what_memlab_full_keeps():
    """HF's per-layer checkpointing and memlab's checkpointing="full" both keep one input per
    decoder layer: the most activations alive at once agree within 5%, under a sixth of no
    checkpointing's (the loss's logits and log-probabilities are kept either way)."""
    kept = {}
    for ckpt in ("none", "full"):
        _, _, hf_rep = _measure(SMALL, checkpointing=ckpt)
        ml = measure_step(step_config(SMALL, seq=SEQ, batch=BATCH, checkpointing=ckpt))
        kept[ckpt] = [max(e.by_category[ACT] for e in r.timeline) for r in (hf_rep, ml)]
    assert kept["full"][0] == pytest.approx(kept["full"][1], rel=0.05)
    assert kept["full"][0] < kept["none"][0] / 6


@pytest.mark.parametrize("name", ["tiny", "gpt2-small", "llama-3-8b", "qwen2.5-7b"])
def test_param_shapes_equal_the_model(name):
    with torch.device("meta"):
        model = GPT(PRESETS[name])
    assert sorted(p.numel() for p in model.parameters()) == sorted(
        PRESETS[name].param_numels())
    assert low_bit.adam_state_bytes(PRESETS[name].param_numels()) == \
        8 * PRESETS[name].num_params()


def test_8bit_state_is_about_a_quarter():
    from memlab import StepConfig, estimate_step
    step = StepConfig(model="llama-3-8b", seq=2048, batch=1, precision="bf16",
                      checkpointing="full")
    eight = finetune.estimate_8bit(step, target="cuda")
    full = estimate_step(step, target="cuda")
    per_param = eight.by_category["optimizer"] / PRESETS["llama-3-8b"].num_params()
    # 2 bytes of moments and 2 x 4 / 256 of block maxima per parameter
    assert 2 + 8 / 256 <= per_param < 2 + 8 / 256 + 0.001
    assert full.peak_bytes - eight.peak_bytes == full.by_category["optimizer"] - eight.by_category["optimizer"]


def test_8bit_layout_equals_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1000), torch.nn.Linear(1000, 64))
    opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    # each storage once: every state holds the optimizer's own two quantisation maps
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for s in opt.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0}
    assert sum(storages.values()) == low_bit.adam_state_bytes([p.numel() for p in model.parameters()],
                                                              "adamw-8bit")


def test_will_it_fit_panel_redraws_with_the_estimate():
    pytest.importorskip("ipywidgets")
    from memlab.classroom.widgets import FinetunePanel
    panel = FinetunePanel("llama-3-8b", "A100-80GB")
    full = panel.data.peak_bytes
    panel.lora.value = "r=16 all linear"  # a click, from code
    lora = LoraConfig(rank=16, targets=LLAMA_TARGETS)
    expected = estimate_hf("llama-3-8b", seq=512, batch=1, precision="bf16", checkpointing="none",
                           lora=lora, budget="A100-80GB", target="cuda")
    assert panel.data.peak_bytes == expected.peak_bytes < full
    assert panel.data.fits is True and "fits" in panel.status.value
    panel.seq.value = 4096
    assert panel.data.peak_bytes == estimate_hf(
        "llama-3-8b", seq=4096, batch=1, precision="bf16", checkpointing="none", lora=lora,
        budget="A100-80GB", target="cuda").peak_bytes


def _cli_json(capsys, argv):
    import json

    from memlab.app.cli import main
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_real_peft_lora_step_from_the_cli(tmp_path, capsys):
    """A real peft LoRA step on this CPU (q/v adapters, r=8) against the CLI: estimate within 5%,
    simulate (peft on fake tensors) within 1%."""
    import json
    _, _, real = _measure(SMALL, lora=_lora(["q_proj", "v_proj"]))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(SMALL))
    argv = ["--hf-config", str(cfg), "--seq", str(SEQ), "--batch", str(BATCH), "--target", "cpu",
            "--lora-rank", "8", "--lora-targets", "q_proj,v_proj", "--json"]
    est = _cli_json(capsys, ["estimate", *argv])
    sim = _cli_json(capsys, ["simulate", *argv])
    assert est["peak_bytes"] == pytest.approx(real.peak_bytes, rel=0.05)
    assert sim["peak_bytes"] == pytest.approx(real.peak_bytes, rel=0.01)


#: Llama-3-8B (its config.json, memlab/data/hf_configs): 32 layers of q, k, v, o and the
#: SwiGLU MLP; 8,030,261,248 parameters (the count transformers' model reports)
L3_LAYERS, L3_PARAMS = 32, 8_030_261_248
L3_LINEARS = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "v_proj": (1024, 4096), "o_proj": (4096, 4096),
              "gate_proj": (14336, 4096), "up_proj": (14336, 4096), "down_proj": (4096, 14336)}


def _nf4_bytes(n: int, F) -> tuple[int, int]:
    """(bytes, code-table bytes) bitsandbytes holds for ``n`` weights quantised to NF4 with
    double quantisation (blocks of 64, the block maxima quantised in blocks of 256); the bytes
    include the code tables, which every weight's state holds its own copy of."""
    q, s = F.quantize_4bit(torch.randn(n, dtype=torch.bfloat16), blocksize=64, compress_statistics=True,
                           quant_type="nf4")
    codes = sum(t.numel() * t.element_size() for t in (s.code, s.state2.code))
    return sum(t.numel() * t.element_size() for t in (q, s.absmax, s.offset, s.state2.absmax)) + codes, codes


def test_lora_and_qlora_of_an_8b_from_the_cli(capsys):
    """Llama-3-8B (shipped config), bf16, checkpointing: LoRA holds less than half of full
    fine-tuning; QLoRA less than LoRA, its parameters exactly what bitsandbytes holds: every
    decoder Linear in NF4 as bitsandbytes' own quantize_4bit lays it out (measured here on
    tensors of 16384 and 4194304 elements: every Linear of the 8B is a multiple of 16384
    elements, 64 x 256, so its bytes are the affine function those two give), the embedding,
    head and norms in bf16, and peft's 41,943,040 adapter parameters in fp32."""
    F = pytest.importorskip("bitsandbytes.functional")
    argv = ["estimate", "--hf-config", "llama-3-8b", "--seq", "2048", "--batch", "1",
            "--precision", "bf16", "--checkpointing", "full", "--gpu", "A100-80GB", "--json"]
    full = _cli_json(capsys, argv)
    lora = _cli_json(capsys, [*argv, "--lora-rank", "16"])
    qlora = _cli_json(capsys, [*argv, "--lora-rank", "16", "--load-in-4bit"])
    assert full["config"]["num_params"] == L3_PARAMS
    assert lora["peak_bytes"] < full["peak_bytes"] / 2
    assert qlora["peak_bytes"] < lora["peak_bytes"]
    (small, codes), (large, _) = _nf4_bytes(16384, F), _nf4_bytes(4194304, F)
    per_element = (large - small) / (4194304 - 16384)
    assert per_element == 1 / 2 + 1 / 64 + 4 / (64 * 256)  # packed pairs, uint8 maxima, fp32 nested maxima
    numels = [o * i for o, i in L3_LINEARS.values()]
    assert all(n % 16384 == 0 for n in numels)
    nf4 = L3_LAYERS * sum(small + per_element * (n - 16384) for n in numels)
    adapters = L3_LAYERS * sum(16 * (o + i) for o, i in L3_LINEARS.values())  # LoRA: A r x in, B out x r
    assert adapters == 41_943_040
    want = nf4 + 2 * (L3_PARAMS - L3_LAYERS * sum(numels)) + 4 * adapters
    assert qlora["by_category"]["parameters"] == want
    # bitsandbytes 0.50 gives every weight its own NF4 and nested code tables (16 + 256 fp32)
    assert codes == 4 * (16 + 256)


@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 64), (688, 256)])
@pytest.mark.parametrize("double_quant", [True, False])
def test_4bit_layout_equals_bitsandbytes(shape, double_quant):
    """bitsandbytes' own quantize_4bit on this CPU: the packed NF4 bytes, the block maxima and,
    with double quantization, the nested maxima and offset, and the state's code tables."""
    F = pytest.importorskip("bitsandbytes.functional")
    q, s = F.quantize_4bit(torch.randn(*shape, dtype=torch.bfloat16), blocksize=64,
                           compress_statistics=double_quant, quant_type="nf4")
    held = [q, s.absmax, s.code] + ([s.offset, s.state2.absmax, s.state2.code] if double_quant else [])
    nbytes = sum(t.numel() * t.element_size() for t in held)
    assert nbytes == low_bit.quantized_weight_bytes(*shape, "4bit", double_quant=double_quant)


def test_8bit_weight_layout_equals_bitsandbytes():
    F = pytest.importorskip("bitsandbytes.functional")
    cb, scb, _ = F.int8_vectorwise_quant(torch.randn(688, 256, dtype=torch.float16))
    assert cb.numel() * cb.element_size() + scb.numel() * scb.element_size() == \
        low_bit.quantized_weight_bytes(688, 256, "8bit")


def test_adafactor_state_equals_transformers():
    """transformers' Adafactor (defaults: factored second moment, no first moment) after one step."""
    from transformers.optimization import Adafactor
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 10))
    opt = Adafactor(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    held = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)
    assert held == low_bit.adafactor_state_bytes([tuple(p.shape) for p in model.parameters()])


def test_paged_state_is_host_memory(capsys):
    """paged_adamw_8bit: adamw_bnb_8bit's bytes, the uint8 moments of every tensor of 1e5 elements or more
    in unified memory (host bytes), the rest on the device (bitsandbytes 0.50 ``get_state_buffer``)."""
    import transformers
    argv = ["estimate", "--hf-config", "gpt2", "--seq", "128", "--batch", "2", "--target", "cpu", "--json"]
    eight = _cli_json(capsys, [*argv, "--optimizer", "adamw_bnb_8bit"])
    paged = _cli_json(capsys, [*argv, "--optimizer", "paged_adamw_8bit"])
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config())  # GPT-2 small, the shipped config
    unified = sum(2 * p.numel() for p in model.parameters() if p.numel() >= 100_000)
    assert 0 < unified < eight["by_category"]["optimizer"]
    assert paged["host_by_category"]["optimizer"] == unified
    assert paged["by_category"]["optimizer"] == eight["by_category"]["optimizer"] - unified
    assert paged["peak_bytes"] == eight["peak_bytes"] - unified
