"""Lesson 01's two splits of the 16 bytes per parameter, measured."""
import memlab as ml
from memlab.techniques.mixed_precision import master_weight_states
from memlab.techniques.sweeps import category_max


def test_master_weights_split_is_zeros_mixed_precision_adam():
    # Rajbhandari et al. 2020, sec. 3.1: 2 (fp16 weights) + 2 (fp16 grads) + K = 12
    # (fp32 master 4 + two fp32 Adam moments 8); bf16 has fp16's 2 bytes per element.
    split = master_weight_states(ml.StepConfig(model="tiny", seq=16, batch=1))
    assert split == {"bf16 parameters": 2.0, "bf16 gradients": 2.0, "fp32 master": 4.0,
                     "Adam moments": 8.0}


def test_autocast_split_is_fp32_weights_and_gradients():
    step = ml.StepConfig(model="tiny", seq=16, batch=1, precision="bf16")
    rep = ml.measure_step(step)
    n = step.model_config.num_params()
    per = {c: category_max(rep, c) / n for c in ("parameters", "gradients", "optimizer")}
    assert per["parameters"] == 4.0 and per["gradients"] == 4.0   # fp32, cast per op
    assert 8.0 <= per["optimizer"] < 8.01                          # two fp32 moments (+ step counters)
