"""How much the tracker slows a step down, and how long a gpt2-xl simulation takes.

Prints ratios, asserts nothing: timings on shared 2-core machines are noisy. Targets: tracked
/ untracked step time < 1.3x on the tiny model; gpt2-xl simulate < 10 s.
"""
import time

from memlab.lenses.simulate import simulate_step
from memlab.step.training_step import StepConfig, build_trainer, make_batch
from memlab.tracking.tracker import MemoryTracker


def step_times(step: StepConfig, repeats: int = 7) -> tuple[float, float]:
    """Fastest untracked and tracked step, interleaved so machine load hits both alike."""
    trainer = build_trainer(step)
    batch = make_batch(step)
    trainer.step(batch)
    plain, tracked = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.step(batch)
        plain.append(time.perf_counter() - start)
        start = time.perf_counter()
        with MemoryTracker() as mt:
            mt.track_model(trainer.model)
            trainer.step(batch)
        tracked.append(time.perf_counter() - start)
    return min(plain), min(tracked)


if __name__ == "__main__":
    for step in (StepConfig(), StepConfig(seq=128, batch=4), StepConfig(checkpointing="full")):
        plain, tracked = step_times(step)
        print(f"tiny seq {step.seq} batch {step.batch} ckpt {step.model_config.checkpointing}: "
              f"untracked {plain * 1e3:.0f} ms, tracked {tracked * 1e3:.0f} ms, "
              f"ratio {tracked / plain:.2f}x (target < 1.3x)")
    start = time.perf_counter()
    rep = simulate_step(StepConfig(model="gpt2-xl", seq=1024, batch=1))
    print(f"gpt2-xl seq 1024 batch 1 simulate: {time.perf_counter() - start:.1f} s "
          f"(target < 10 s), peak {rep.peak_bytes / 2**30:.2f} GiB")
