"""Activation offloading (memlab.step.activation_offload): on a CPU device save_on_cpu moves
nothing; on a simulated GPU every saved tensor goes to the host, as many bytes as the
saved-tensor hooks see a real forward save."""
from dataclasses import replace

import pytest
import torch

from memlab.app.cli import main
from memlab.core.torch_private import FakeTensorMode
from memlab.lenses.measure import measure_step, run_tracked_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import tiny_llama
from memlab.step.activation_offload import saved_bytes
from memlab.step.training_step import StepConfig, autocast_for, build_trainer, make_batch

LLAMA = tiny_llama(d_model=256, n_layer=4, mlp_hidden=512)


def test_on_a_cpu_device_save_on_cpu_moves_nothing():
    step = StepConfig(seq=64, batch=4)
    plain, off = measure_step(step), measure_step(replace(step, activation_offload=True))
    assert off.peak_bytes == plain.peak_bytes and off.host_bytes == 0
    assert any("nothing moves" in n for n in simulate_step(replace(step, activation_offload=True),
                                                          target="cpu").notes)


@pytest.mark.parametrize("model, precision", [("tiny", "fp32"), (LLAMA, "bf16")])
def test_host_bytes_are_what_the_hooks_save(model, precision):
    """The fake step offloaded to the host: the tracker's host peak (the packed copies, all
    alive at the end of forward) equals the bytes a real forward's saved-tensor hooks see, and
    the device keeps almost no activations at the end of forward."""
    step = StepConfig(model=model, seq=32, batch=2, precision=precision, activation_offload=True)
    real = build_trainer(step)
    batch = make_batch(step)

    def forward():
        with autocast_for(precision, real.device):
            real.model(*batch)
    expected = saved_bytes(forward)
    with FakeTensorMode():
        fake = build_trainer(step, fake=True)
        fake.offload_to_host = True
        vocab = step.model_config.vocab_size
        fb = tuple(torch.randint(0, vocab, (2, 32)) for _ in range(2))
        tracker, *_ = run_tracked_step(fake, fb, None, warmup="optimizer")
        assert tracker.host_peak_bytes == expected
        plain = build_trainer(replace(step, activation_offload=False), fake=True)
        base, *_ = run_tracked_step(plain, fb, None, warmup="optimizer")
    def forward_end(t):
        return max(e.by_category[3] for e in t.timeline if e.phase == "forward")
    assert forward_end(tracker) <= 0.1 * forward_end(base)


def test_cli_flag_and_the_time_note(capsys):
    assert main(["simulate", "--seq", "32", "--batch", "2", "--activation-offload", "--gpu", "A100-80GB"]) == 0
    out = capsys.readouterr().out
    assert "over PCIe at 32 GB/s" in out and "host" in out
