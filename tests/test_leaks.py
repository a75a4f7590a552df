"""Step-over-step growth: the three classic leaks measured, and the exercise's checker.

Expected growth per step comes from elsewhere: the logits' shape (b * s * vocab * 4 bytes),
and what one forward keeps alive, measured apart by the tracker on a single forward.
"""
import pytest
import torch
import torch.nn.functional as F

from memlab.classroom.exercises import CheckFailed, check_leak_fixed
from memlab.techniques.leaks import tiny_setup, watch_steps
from memlab.tracking.tracker import MemoryTracker

STEPS, SEQ, BATCH, VOCAB = 5, 64, 4, 1000


def sum_leak(fixed=False):
    model, opt, batch_at = tiny_setup()
    total_val = 0
    for i in range(STEPS):
        loss = model(*batch_at(i))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        val = model(*batch_at(10_000))
        total_val += val.item() if fixed else val


def eval_leak(fixed=False):
    model, opt, batch_at = tiny_setup()
    history = []
    for i in range(STEPS):
        loss = model(*batch_at(i))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad() if fixed else torch.enable_grad():
            history.append(model(*batch_at(10_000)))


def list_leak(fixed=False):
    model, opt, batch_at = tiny_setup()
    outputs = []
    for i in range(STEPS):
        x, y = batch_at(i)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        outputs.append((logits.argmax(-1) == y).float().mean().item() if fixed else logits)


def _one_forward_keeps() -> int:
    model, _, batch_at = tiny_setup()
    with MemoryTracker() as mt:
        mt.track_model(model)
        before = mt.live_bytes
        loss = model(*batch_at(10_000))
        kept = mt.live_bytes - before
    del loss
    return kept


@pytest.fixture(scope="module")
def forward_keeps():
    return _one_forward_keeps()


@pytest.mark.parametrize("leak", [sum_leak, eval_leak])
def test_kept_graphs_grow_by_one_forward_per_step(leak, forward_keeps):
    growth = watch_steps(leak)
    assert growth.steps == STEPS
    assert growth.per_step == pytest.approx(forward_keeps, abs=8)  # and the 4-byte sum
    assert set(growth.per_step_by_category()) == {"activations"}
    assert watch_steps(lambda: leak(fixed=True)).per_step <= 4  # a kept scalar at most


def test_kept_logits_grow_by_their_size():
    assert watch_steps(list_leak).per_step == BATCH * SEQ * VOCAB * 4
    assert watch_steps(lambda: list_leak(fixed=True)).per_step == 0


def test_summed_loss_after_backward_keeps_no_tensor():
    """PyTorch's FAQ warns about ``total_loss += loss``: with backward() every step the saved
    tensors are freed, and the sum keeps only autograd nodes (host memory, no tensor)."""
    def loop():
        model, opt, batch_at = tiny_setup()
        total = 0
        for i in range(STEPS):
            loss = model(*batch_at(i))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            total += loss
        assert total.grad_fn is not None
    growth = watch_steps(loop)
    assert growth.per_step == 0 and growth.live_after[-1] - growth.live_after[0] == 4  # the sum


@pytest.mark.parametrize("leak", [sum_leak, eval_leak, list_leak])
def test_checker_fails_each_leak_with_its_growth_and_passes_the_fix(leak):
    with pytest.raises(CheckFailed, match=r"still grows [0-9.]+ [KM]iB per step \(activations"):
        check_leak_fixed(leak, budget="1GiB", past_step=STEPS - 1)
    result = check_leak_fixed(lambda: leak(fixed=True), budget="1GiB", past_step=STEPS - 1)
    assert result.measured["steps"] == STEPS


SCRIPT = """
from memlab.techniques.leaks import tiny_setup
model, opt, batch_at = tiny_setup()
total_val = 0
for i in range({steps}):
    loss = model(*batch_at(i))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    total_val += model(*batch_at(10_000)){fix}
"""


def test_buggy_script_runs_out_of_memory_and_the_fix_runs_past_it(tmp_path, forward_keeps):
    steady = watch_steps(SCRIPT.format(steps=2, fix=".item()"))
    budget = steady.live_after[-1] + int(3.5 * forward_keeps)
    buggy = watch_steps(SCRIPT.format(steps=8, fix=""), budget=budget)
    assert buggy.oom is not None and 2 <= buggy.oom_step <= 5
    with pytest.raises(CheckFailed, match=f"ran out of memory in step {buggy.oom_step}"):
        check_leak_fixed(SCRIPT.format(steps=8, fix=""), budget=budget, past_step=buggy.oom_step)
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(steps=8, fix=".item()"))
    assert check_leak_fixed(str(path), budget=budget, past_step=buggy.oom_step).measured["steps"] == 8
    with pytest.raises(CheckFailed, match="ran 8 optimizer steps; run it past step 9"):
        check_leak_fixed(path, budget=budget, past_step=9)
    with pytest.raises(CheckFailed, match="write `train`"):  # the student copy's stub
        check_leak_fixed(None, budget=budget, past_step=9)
