"""torchtune's compile (``StepConfig(compile="layers")``) composed with what its later README rows add
(issue 39): full activation checkpointing, the optimizer step in backward, activation offloading.

torchtune compiles each decoder layer, then wraps each in a non-reentrant ``checkpoint_wrapper``
(recipes/full_finetune_single_device.py:424-430 at 1814feb17): the checkpoint runs eager around the
compiled call (:class:`memlab.step.compiled.CheckpointedRegion`). Each composition is a real inductor
compile on this CPU, its peak read from the allocator's events, against the simulation and the
estimate, which run inductor's partition and generated wrapper per region on fake tensors.

The model: memlab's tiny Llama with torchtune's fp32 RMSNorm (``norm_fp32``), widened so that the
checkpointed blocks, not the loss, hold the peak (d_model 256 against a 256-token vocabulary).
Attention is ``naive``: with SDPA the peak of a checkpointed step moves into the CPU flash-attention
backward, whose kernel allocates scratch that no tensor returns (on the two-thread test machine
262,144 + 131,072 + 256 + 116,480 + 4 = 509,956 bytes, read from the allocator's events; -3.2% there),
which fake tensors cannot see; CUDA's FlashAttention workspace is counted by the CUDA target's
accounting instead (memlab.policy).

Activation offloading on a CPU device moves nothing (``save_on_cpu`` packs with ``tensor.cpu()``,
the tensor itself): both lenses agree there (memlab.step.activation_offload). So the offloaded step
is also measured with saved tensors leaving the device: the real CPU step runs the simulation's own
offload hooks (each saved tensor packed to an empty ``meta`` tensor, unpacked into a new CPU tensor),
so the allocator sees what a GPU's would: the tensors freed at forward and brought back in backward.
"""
import pytest

import memlab.lenses.estimate as estimate_module
import memlab.step.training_step as training_step
from memlab.lenses.estimate import estimate_step
from memlab.lenses.measure import measure_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import tiny_llama
from memlab.step.activation_offload import offload_context
from memlab.step.training_step import StepConfig

MODEL = tiny_llama(vocab=256, d_model=256, n_head=4, n_kv_head=2, mlp_hidden=512, norm_fp32=True,
                   attention="naive")
COMPILED = dict(model=MODEL, seq=256, batch=2, precision="pure-bf16", compile="layers")
CHECKPOINTED = dict(COMPILED, checkpointing="full")
IN_BACKWARD = dict(CHECKPOINTED, optimizer_in_backward=True)
OFFLOADED = dict(IN_BACKWARD, activation_offload=True)

#: measured peaks when written (this repository's CPU run, torch 2.13), the bounds' anchor: the
#: simulation read -0.06%, -0.10%, -0.10% (CPU: nothing moves) and -0.10% (saved tensors to meta);
#: the estimate 68 bytes under the simulation
MEASURED_WHEN_WRITTEN = {"checkpointed": 16_626_632, "in_backward": 15_581_576, "offloaded": 15_581_576,
                         "offloaded_to_meta": 15_319_432}
STEPS = {"checkpointed": CHECKPOINTED, "in_backward": IN_BACKWARD, "offloaded": OFFLOADED,
         "offloaded_to_meta": OFFLOADED}


def _to_meta(device, *, to_host: bool, fake: bool = False):
    """The simulation's offload hooks on any step: saved tensors leave the device (to ``meta``)."""
    return offload_context(device, to_host=True, fake=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STEPS))
def test_compiled_layers_compose_as_torchtune_runs_them_within_2_percent_of_measured(name, monkeypatch):
    """A real compile of each composition (about a minute each on two cores) against the
    simulation and the estimate: within 0.5% (-0.06% to -0.10% when written; the issue asked for 2%)."""
    if name == "offloaded_to_meta":
        monkeypatch.setattr(training_step, "offload_context", _to_meta)
        monkeypatch.setattr(estimate_module, "offload_context", _to_meta)
        # the traced pass is cached per shape: the "offloaded" step's (nothing moved) is not this one's
        monkeypatch.setattr(estimate_module, "compiled_pass_bytes",
                            estimate_module.compiled_pass_bytes.__wrapped__)
    step = StepConfig(**STEPS[name])
    real = measure_step(step)
    assert real.peak_bytes == pytest.approx(MEASURED_WHEN_WRITTEN[name], rel=0.01)
    sim = simulate_step(step, target="cpu")
    assert sim.live_before == real.live_before
    assert sim.peak_bytes == pytest.approx(real.peak_bytes, rel=0.005)
    assert estimate_step(step, target="cpu").peak_bytes == pytest.approx(real.peak_bytes, rel=0.005)

