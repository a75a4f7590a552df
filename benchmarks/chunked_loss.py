"""Plain vs chunked linear + cross-entropy: tracked peak and time of one forward + backward.

For a few vocabulary x sequence sizes (batch 1, d_model 64, fp32 on CPU) prints the peak
bytes the loss adds on top of its inputs (``MemoryTracker``), the median time of 3
interleaved runs, and the ratios chunked / plain. Asserts nothing: timings on shared 2-core
machines are noisy. The peak ratio falls as tokens grow (the plain loss holds about
3 x tokens x vocab x 4 bytes at its peak, the chunked one about two chunks of logits plus a
vocab x d_model weight-gradient term, whatever the number of tokens). The chunked loss does
one more head matmul (the recomputation in backward) and loops over chunks in Python:
expect it 1.2-2.5x slower here (on a loaded 2-core machine, fp32: 1.19-2.28x); fused GPU
kernels (Liger, Cut Cross-Entropy) hide most of that.

Run: ``python benchmarks/chunked_loss.py`` (about 20 s of CPU time; the wall time grows
with the machine's load).
"""
import time

import torch

from memlab.core.units import fmt_bytes
from memlab.models.chunked_loss import linear_cross_entropy, loss_spike_bytes, plain_linear_cross_entropy
from memlab.tracking.tracker import MemoryTracker

D_MODEL, CHUNK = 64, 128
SIZES = [(32000, 256), (32000, 1024), (128256, 512)]  # (vocab, tokens)


def _inputs(vocab: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, D_MODEL, generator=g).requires_grad_(True)
    weight = (torch.randn(vocab, D_MODEL, generator=g) * D_MODEL ** -0.5).requires_grad_(True)
    return hidden, weight, torch.randint(0, vocab, (tokens,), generator=g)


def _run(fn, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> None:
    hidden.grad = weight.grad = None
    fn(hidden, weight, target).backward()


def peak_above_inputs(fn, vocab: int, tokens: int) -> int:
    """Tracked peak of one forward + backward, minus the inputs that existed before it."""
    hidden, weight, target = _inputs(vocab, tokens)
    with MemoryTracker() as mt:
        mt.track_tensors([hidden, weight, target])
        before = mt.live_bytes
        mt.reset_peak()
        _run(fn, hidden, weight, target)
    return mt.peak_bytes - before


def median_times(fns: dict, vocab: int, tokens: int, repeats: int = 3) -> dict[str, float]:
    """Median seconds per function, run in turn so machine load falls on all alike."""
    hidden, weight, target = _inputs(vocab, tokens)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            _run(fn, hidden, weight, target)
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


if __name__ == "__main__":
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    fns = {"plain": plain_linear_cross_entropy,
           "chunked": lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=CHUNK)}
    print(f"d_model {D_MODEL}, chunk {CHUNK} tokens, fp32, batch 1; peak = bytes above the inputs")
    print(f"{'vocab':>7} {'tokens':>6} {'logits+lsm':>11} {'plain peak':>11} {'chunked':>10} "
          f"{'peak ratio':>10} {'plain ms':>9} {'chunked ms':>10} {'time ratio':>10}")
    for vocab, tokens in SIZES:
        peaks = {name: peak_above_inputs(fn, vocab, tokens) for name, fn in fns.items()}
        times = median_times(fns, vocab, tokens)
        print(f"{vocab:>7} {tokens:>6} {fmt_bytes(loss_spike_bytes(tokens, vocab)):>11} "
              f"{fmt_bytes(peaks['plain']):>11} {fmt_bytes(peaks['chunked']):>10} "
              f"{peaks['chunked'] / peaks['plain']:>10.3f} {times['plain'] * 1e3:>9.0f} "
              f"{times['chunked'] * 1e3:>10.0f} {times['chunked'] / times['plain']:>10.2f}")
