"""memlab.policy: the device rules, and their emulation on CPU tensors leaving no trace."""
import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from memlab.app.cli import main
from memlab.lenses.estimate import estimate_step
from memlab.lenses.measure import measure_step
from memlab.lenses.simulate import simulate_step
from memlab.models.gpt_unet import get_config
from memlab.policy import (
    CPU_AUTOCAST,
    CUDA_AUTOCAST,
    attention_probs_bytes,
    conv_workspace,
    cross_entropy_moments,
    cublas_workspace_bytes,
    cublaslt_workspace_bytes,
    emulate,
    get_target,
    sdpa_lse_bytes,
)
from memlab.step.training_step import StepConfig
from memlab.tracking.tracker import CATEGORIES, MemoryTracker

MiB = 2**20


def _registered(key: str) -> set[str]:
    return {n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}


@pytest.mark.parametrize("policy, key", [(CUDA_AUTOCAST, "AutocastCUDA"), (CPU_AUTOCAST, "AutocastCPU")])
def test_op_lists_are_the_ones_torch_registers(policy, key):
    # the installed torch's own dispatcher table, independent of the copied lists
    assert policy.ops == _registered(key)


def test_cpu_rules_are_what_cpu_autocast_does():
    """The CPU table's rules against torch's CPU autocast itself: the dtype each op returns
    (the CUDA table's rules are checked by the H200 reference, tests/test_gpu_reference.py)."""
    x = torch.randn(4, 8)
    img = torch.randn(1, 4, 2, 2, dtype=torch.bfloat16)  # every op gets a 16-bit input
    target = torch.randint(0, 8, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ torch.randn(8, 8)  # a bf16 matmul output
        seen = {"softmax.int": F.softmax(h, -1).dtype, "group_norm": F.group_norm(img, 2).dtype,
                "cross_entropy_loss": F.cross_entropy(h, target, reduction="none").dtype}
    rules = {op: CPU_AUTOCAST.rule(op) for op in seen}
    for op, dtype in seen.items():
        # "fp32": the op is cast up; None: the op runs in its input's dtype (bf16 here)
        assert (rules[op] == "fp32") == (dtype == torch.float32), (op, rules[op], dtype)


def test_bad_target_is_rejected():
    with pytest.raises(ValueError, match="target='tpu'; allowed: cuda, cpu"):
        get_target("tpu")
    with pytest.raises(ValueError, match="target='gpu'"):
        simulate_step(StepConfig(seq=32, batch=2), target="gpu")


def test_cublas_workspace_follows_torchs_rules():
    # CublasHandlePool.cpp: 4096 KiB x 8 on sm90, 4096 KiB x 2 + 16 KiB x 8 otherwise
    assert cublas_workspace_bytes((9, 0), env={}) == 32 * MiB
    assert cublas_workspace_bytes((8, 0), env={}) == 8 * MiB + 128 * 1024
    assert cublas_workspace_bytes((9, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":16:8"}) == 128 * 1024
    assert cublas_workspace_bytes((9, 0), env={"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8"}) == \
        8 * MiB + 128 * 1024
    assert cublaslt_workspace_bytes(env={}) == MiB
    assert get_target("cuda", "A100-40GB").resident_workspace() == 2 * (8 * MiB + 128 * 1024 + MiB)


def test_element_rules():
    # naive attention: CUDA keeps fp32 probabilities and their 16-bit copy for P @ V
    assert attention_probs_bytes("cuda", "bf16") == 4 + 2
    assert attention_probs_bytes("cpu", "bf16") == 2
    # the loss at its first backward op: CUDA saves 16-bit log-probs and an fp32 copy
    assert cross_entropy_moments("cuda", "bf16")[1] == ("loss backward", 2 + 4, 4)
    assert cross_entropy_moments("cpu", "bf16")[1] == ("loss backward", 4, 4)
    # FlashAttention-2 keeps (b, h, s) fp32; the efficient kernel pads s to 32
    assert sdpa_lse_bytes("flash", 2, 3, 100) == 4 * 2 * 3 * 100
    assert sdpa_lse_bytes("efficient", 2, 3, 100) == 4 * 2 * 3 * 128
    assert conv_workspace(64, (3, 3), (32, 32), (1, 1), 4) == 64 * 9 * 1024 * 4
    assert conv_workspace(64, (1, 1), (32, 32), (1, 1), 4) == 0


def _ops_seen(fn) -> list[str]:
    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))
    with Log() as log:
        fn()
    return log.ops


def _autocast_dtypes():
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    img = torch.randn(1, 4, 2, 2, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ w
        return {"matmul": h.dtype, "softmax": F.softmax(h, -1).dtype,
                "layer_norm": F.layer_norm(h, (8,)).dtype, "group_norm": F.group_norm(img, 2).dtype,
                "upsample": F.interpolate(img, scale_factor=2).dtype}


def test_emulation_applies_cudas_policy_and_removes_it_after():
    before = _autocast_dtypes()
    with emulate("cuda"):
        inside = _autocast_dtypes()
    after = _autocast_dtypes()
    # CPU autocast leaves these in bf16; CUDA's lists run all but the matmul in fp32
    assert before == after == dict.fromkeys(before, torch.bfloat16)
    assert inside == {"matmul": torch.bfloat16, "softmax": torch.float32,
                      "layer_norm": torch.float32, "group_norm": torch.float32,
                      "upsample": torch.float32}


def test_emulation_is_removed_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with emulate("cuda"):
            raise RuntimeError("boom")
    assert _autocast_dtypes()["softmax"] == torch.bfloat16
    assert torch.clear_autocast_cache.__module__ == "torch"


def test_a_real_cpu_step_after_a_cuda_simulation_is_unchanged():
    step = StepConfig(seq=64, batch=2, precision="bf16")
    first = measure_step(step)
    simulate_step(step, target="cuda")
    again = measure_step(step)
    assert again.peak_bytes == first.peak_bytes and again.by_category == first.by_category
    # and the CPU target still equals the real CPU step to the byte
    assert simulate_step(step, target="cpu").by_category == first.by_category


def test_weight_casts_are_cached_until_autocast_exits():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(2, 8)

    def two_uses():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.linear(x, w)
            F.linear(x, w)

    with emulate("cuda"):
        first, second = _ops_seen(two_uses), _ops_seen(two_uses)
    # one cast of w (plus one of x per call) per autocast region, again in the next region
    assert first.count("_to_copy.default") == second.count("_to_copy.default") == 1 + 2


def test_fused_rms_norm_saves_input_and_rstd_and_gets_the_same_gradients():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    ref = F.rms_norm(x, (16,), w, 1e-6)
    gx, gw = torch.autograd.grad(ref.square().sum(), [x, w])
    with emulate("cuda"):
        y = F.rms_norm(x, (16,), w, 1e-6)
        saved = [tuple(t.shape) for t in y.grad_fn.saved_tensors]
        ex, ew = torch.autograd.grad(y.square().sum(), [x, w])
    assert saved == [(3, 5, 16), (3, 5, 1), (16,)]   # input, rstd, weight: nothing else
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close((ex, ew), (gx, gw))


def test_cuda_accounting_rounds_blocks_and_counts_conv_workspace():
    from torch._subclasses.fake_tensor import FakeTensorMode
    target = get_target("cuda")
    with FakeTensorMode():
        x = torch.randn(2, 8, 16, 16)
        w = torch.randn(4, 8, 3, 3)
        with MemoryTracker(accounting=target.accounting()) as mt:
            y = F.conv2d(x, w, padding=1)
            z = torch.empty(3)  # 12 bytes: one 512-byte block
        ws = mt.peak_by_category()["workspace"]
    resident = target.resident_workspace()
    assert ws == resident + 8 * 9 * 16 * 16 * 4      # im2col of one image, fp32
    assert mt.by_category()["workspace"] == 0        # all released on exit
    assert mt.live_bytes == 2 * 4 * 16 * 16 * 4 + 512 and y.shape == (2, 4, 16, 16) and z.numel() == 3
    assert "workspace" == CATEGORIES[-1]


def test_cuda_target_reports_itself_and_its_workspace():
    step = StepConfig(model=get_config("tiny", n_layer=2), seq=64, batch=2, precision="bf16")
    est, sim = estimate_step(step, target="cuda"), simulate_step(step, target="cuda")
    assert est.device == "formula (cuda)" and sim.device == "cuda (fake)"
    assert estimate_step(step).device == "formula (cpu)"
    assert est.by_category["workspace"] == sim.by_category["workspace"] == 66 * MiB
    assert abs(est.peak_bytes - sim.peak_bytes) < 0.05 * sim.peak_bytes


def test_cli_target_flag(capsys):
    args = ["--model", "tiny", "--seq", "64", "--batch", "2", "--json"]
    assert main(["estimate", *args]) == 0
    assert json.loads(capsys.readouterr().out)["device"] == "formula (cuda)"  # the default
    assert main(["simulate", "--target", "cpu", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "cpu (fake)" and out["by_category"]["workspace"] == 0
    assert main(["estimate", "--target", "tpu", *args]) == 2
    assert "target='tpu'; allowed: cuda, cpu" in capsys.readouterr().err
