"""The real-scale calculator: estimate_step's numbers, the card's memory, and a panel that
redraws when a control moves."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from memlab import GPU_PRESETS, GiB, InputError, ParallelDims, StepConfig, estimate_step
from memlab.lenses.calculator import MODELS, calculator, register_model
from memlab.models.gpt_unet import get_config


@pytest.mark.parametrize("kw", [
    dict(model="gpt2-xl", seq=1024, batch=8, precision="fp32"),
    dict(model="llama-3-8b", seq=8192, batch=1, precision="bf16", checkpointing="full",
         zero=3, ranks=8, tensor_parallel=2),
    dict(model="llama-7b", seq=4096, batch=2, precision="bf16", checkpointing="selective",
         zero=1, ranks=4),
])
def test_calculator_is_estimate_step_for_the_same_settings(kw):
    c = calculator(**kw, gpu="H100-80GB")
    step = StepConfig(model=kw["model"], seq=kw["seq"], batch=kw["batch"],
                      precision=kw["precision"], checkpointing=kw.get("checkpointing", "none"),
                      zero=kw.get("zero", 0), world_size=kw.get("ranks", 1))
    e = estimate_step(step, budget="H100-80GB", target="cuda",
                      parallel=ParallelDims(tensor=kw.get("tensor_parallel", 1)))
    assert c.by_category == e.by_category and c.peak_bytes == e.peak_bytes  # exactly
    assert c.card_bytes == GPU_PRESETS["H100-80GB"] and c.fits == (e.peak_bytes <= c.card_bytes)


def test_gpt2_xl_fp32_adamw_is_16_bytes_per_parameter_plus_activations():
    """Lesson 01's 16 B/param: 1.56 B parameters' states alone are ~23 GiB, more than a T4."""
    c = calculator("gpt2-xl", seq=128, batch=1, precision="fp32", gpu="T4-16GB")
    n = get_config("gpt2-xl").num_params()
    states = sum(c.by_category[k] for k in ("parameters", "gradients", "optimizer"))
    assert states == pytest.approx(16 * n, rel=1e-3) and not c.fits
    assert calculator("gpt2-xl", seq=128, batch=1, precision="fp32", gpu="H200-141GB").fits


def test_pipeline_divides_the_model_states_not_the_activations():
    one = calculator("llama-7b", seq=2048, batch=1, ranks=4, zero=0)
    four = calculator("llama-7b", seq=2048, batch=1, ranks=4, zero=0, pipeline=4)
    for k in ("parameters", "gradients", "optimizer"):
        assert four.by_category[k] == one.by_category[k] // 4
    assert four.by_category["activations"] == one.by_category["activations"]


def test_bad_settings_name_the_value_and_what_is_allowed():
    with pytest.raises(InputError, match="allowed: .*gpt2-xl"):
        calculator("gpt5")
    with pytest.raises(InputError, match="multiple of tensor_parallel x pipeline"):
        calculator("gpt2-xl", ranks=2, pipeline=4)
    with pytest.raises(InputError, match="must divide the 48 layers"):
        calculator("gpt2-xl", ranks=5, pipeline=5)
    with pytest.raises(InputError, match="unknown GPU"):
        calculator("gpt2-xl", gpu="B200")


def test_register_model_extends_the_list():
    cfg = get_config("llama-7b", n_layer=2, name="my-llama")
    register_model("my-llama", cfg)
    try:
        assert calculator("my-llama", seq=256).settings["model"] == "my-llama"
        with pytest.raises(InputError):
            register_model("bad", "llama-7b")
    finally:
        MODELS.pop("my-llama")


def test_calculator_panel_redraws_when_a_control_changes():
    from memlab.classroom.widgets import CalculatorPanel
    panel = CalculatorPanel("gpt2-xl", seq=1024, batch=8, precision="fp32", gpu="A100-40GB")
    first = panel.data
    assert first.fits is False and "does not fit" in panel.status.value
    panel.checkpointing.value = "full"
    assert panel.data.checkpointing == "full"
    assert panel.data.by_category["activations"] < first.by_category["activations"] / 4
    panel.gpu.value = "H200-141GB"
    assert panel.data.calculation.card_bytes == GPU_PRESETS["H200-141GB"] and panel.data.fits
    bars = panel.figure.axes[0].patches  # the figure drawn is the new setting's
    assert sum(b.get_width() for b in bars) == pytest.approx(panel.data.peak_bytes / GiB)
    # the panel's numbers are estimate_step's for its settings
    e = estimate_step(StepConfig(model="gpt2-xl", seq=1024, batch=8, precision="fp32",
                                 checkpointing="full"), budget="H200-141GB", target="cuda")
    assert panel.data.peak_bytes == e.peak_bytes
    panel.tensor_parallel.value = 8          # ranks 1: not a valid setting, said in the panel
    assert panel.data.error and "multiple" in panel.data.error
    panel.ranks.value = 8                    # 25 heads: t = 8 is refused by the formulas too
    assert "allowed: 1, 5, 25" in panel.data.error and "not a valid" in panel.status.value
    panel.tensor_parallel.value = 1
    panel.zero.value = 3                     # ZeRO-3 over 8 ranks shards the model states
    assert panel.data.error is None and panel.data.peak_bytes < e.peak_bytes / 2
    plt.close("all")


def test_rotary_models_plan_past_their_context_learned_positions_do_not():
    long = calculator("llama-7b", seq=8192, batch=1, precision="fp32")   # trained at 4096
    short = calculator("llama-7b", seq=4096, batch=1, precision="fp32")
    assert long.by_category["activations"] == pytest.approx(2 * short.by_category["activations"], rel=0.01)
    with pytest.raises(InputError, match="exceeds the model's block size"):
        calculator("gpt2-xl", seq=2048)
