"""Pre-flight check for a class: can this machine run the workbook, and where does each lesson run?

    memlab doctor [--no-build] [--json]        # or: make doctor

Prints one line per fact (Python and package versions, CPU cores and RAM, each GPU's name,
memory, capability and native bf16, DeepSpeed's CPU Adam op and its cache folder, two ranks
starting), then a one-line verdict: which lessons run on the GPU, which on the CPU. Exits 1
only when something blocks the workbook (``FAIL`` lines); ``warn`` lines say what is slower or
left out.

The decisions are plain functions of the facts (:func:`gpu_facts`, :func:`lesson_places`,
:func:`verdict`), unit-tested with patched device properties; :func:`collect` gathers the facts.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

import psutil
import torch
from torch.utils.flop_counter import FlopCounterMode

from memlab.core.cards import detect_card
from memlab.core.errors import InputError
from memlab.core.hardware import place_ranks
from memlab.core.units import fmt_bytes
from memlab.distributed.offload import cpu_adam_buildable
from memlab.distributed.ranks import RankError, allreduce_worker, run_ranks, set_cache_env
from memlab.time.flops import CPU_SDPA
from memlab.time.step_time import Calibration, ElementwiseRates, calibration_path

if TYPE_CHECKING:
    import pathlib

MIN_PYTHON = (3, 10)
# one-process lessons, and the lessons that start two ranks (the Makefile runs those alone)
SINGLE_LESSONS = ("00", "01", "02", "03", "04", "05", "06", "07", "08", "14", "16", "17")
RANK_LESSONS = ("09", "10", "11", "12", "13", "15")
OFFLOAD_LESSON = "11"          # runs one rank per GPU so that device and host are two memories
DEEPSPEED_LESSONS = ("10", "11", "15")
MIN_RAM = 4 * 2**30            # a kernel plus two ranks (course/running-a-class.md)
# bf16 tensor-core kernels arrived with Ampere (sm_80); older cards emulate bf16 or refuse it
BF16_NATIVE_FROM = (8, 0)


@dataclass
class Check:
    """One line of the report: ``status`` is "ok", "warn" or "FAIL" (blocks the workbook)."""

    name: str
    status: str
    detail: str

    def __str__(self) -> str:
        return f"{self.status:<4}  {self.name}: {self.detail}"


@dataclass(frozen=True)
class GpuFacts:
    """What the doctor reports of one GPU (:func:`gpu_facts`)."""

    name: str
    """The device's name."""
    memory: int
    """Its total memory in bytes."""
    capability: str
    """The compute capability, ``"major.minor"``."""
    bf16_native: bool
    """Whether it runs bf16 natively (from :data:`BF16_NATIVE_FROM`)."""


def gpu_facts(props) -> GpuFacts:
    """Name, memory, capability and native bf16 of one GPU, from ``torch.cuda.get_device_properties``."""
    capability = (int(props.major), int(props.minor))
    return GpuFacts(name=props.name, memory=int(props.total_memory),
                    capability=f"{capability[0]}.{capability[1]}", bf16_native=capability >= BF16_NATIVE_FROM)


def lesson_places(gpus: int) -> dict[str, str]:
    """Where each lesson runs with ``gpus`` CUDA GPUs: "gpu", "gpu ranks" or "cpu" / "cpu ranks".

    Rank lessons follow :func:`memlab.core.hardware.place_ranks` for two ranks (the offload lesson
    with ``shrink=True``), the one place memlab decides rank placement."""
    places = {n: ("gpu" if gpus >= 1 else "cpu") for n in SINGLE_LESSONS}
    for n in RANK_LESSONS:
        placement = place_ranks(2, gpus, shrink=(n == OFFLOAD_LESSON))
        places[n] = "gpu ranks" if placement.backend == "nccl" else "cpu ranks"
    return dict(sorted(places.items()))


def verdict(places: dict[str, str], blocked: list[str]) -> str:
    """One line: which lessons run on the GPU, which on the CPU (or what blocks the workbook)."""
    if blocked:
        return f"verdict: the workbook cannot run here: {'; '.join(blocked)}"
    on_gpu = [n for n, p in places.items() if p.startswith("gpu")]
    on_cpu = [n for n, p in places.items() if p.startswith("cpu")]
    parts = []
    if on_gpu:
        parts.append(f"on the GPU: {' '.join(on_gpu)}")
    if on_cpu:
        parts.append(f"on the CPU: {' '.join(on_cpu)}"
                     + (" (two gloo ranks for " + " ".join(n for n in on_cpu if n in RANK_LESSONS) + ")"
                        if any(n in RANK_LESSONS for n in on_cpu) else ""))
    return "verdict: lessons " + "; ".join(parts)


def _version(module: str) -> str | None:
    try:
        return version(module)
    except PackageNotFoundError:
        return None


def _ram_bytes() -> int:
    return int(psutil.virtual_memory().total)


CPU_ADAM_PROBE = ("import os, time; t = time.time()\n"
                  "from deepspeed.ops.op_builder import CPUAdamBuilder\n"
                  "CPUAdamBuilder().load()\n"
                  "print(f'{time.time() - t:.1f}')\n")


def check_cpu_adam(timeout: float = 900.0) -> Check:
    """Build (or load from the cache) DeepSpeed's CPU Adam op in a child process."""
    set_cache_env()
    cache = os.environ["TORCH_EXTENSIONS_DIR"]
    ok, why = cpu_adam_buildable()
    if not ok:
        return Check("deepspeed cpu_adam", "warn", f"cannot build ({why}); the offload lesson's CPU Adam "
                     f"part is skipped, the rest runs. cache: {cache}")
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cpu")
    try:
        done = subprocess.run([sys.executable, "-c", CPU_ADAM_PROBE], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Check("deepspeed cpu_adam", "warn", f"no build after {timeout:g} s (a stale 'lock' "
                     f"file under {cache}? delete it). cache: {cache}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return Check("deepspeed cpu_adam", "warn", f"build failed: {last}. cache: {cache}")
    secs = done.stdout.strip().splitlines()[-1]
    return Check("deepspeed cpu_adam", "ok", f"built/loaded in {secs} s; cache: {cache} "
                 f"(TORCH_EXTENSIONS_DIR)")


def check_two_ranks(timeout: float = 120.0) -> Check:
    """Start two gloo ranks and all-reduce once: what every rank lesson needs."""
    try:
        out = run_ranks(allreduce_worker, 2, kwargs={"value": 1.0}, timeout=timeout, backend="gloo")
    except RankError as e:
        return Check("two ranks", "FAIL", f"gloo ranks did not start: {e}")
    if [r["sum"] for r in out] != [3.0, 3.0]:
        return Check("two ranks", "FAIL", f"all-reduce gave {[r['sum'] for r in out]}, expected 3.0 on both")
    return Check("two ranks", "ok", "2 gloo ranks started and all-reduced (1 + 2 = 3)")


def collect(build: bool = True) -> tuple[list[Check], dict[str, str]]:
    """Every check on this machine, and where each lesson runs."""
    checks = []
    py = sys.version_info[:3]
    checks.append(Check("python", "ok" if py[:2] >= MIN_PYTHON else "FAIL",
                        f"{'.'.join(map(str, py))} ({platform.platform()})"
                        + ("" if py[:2] >= MIN_PYTHON else f"; memlab needs {MIN_PYTHON[0]}.{MIN_PYTHON[1]}+")))
    for pkg, need in (("torch", "FAIL"), ("numpy", "FAIL"), ("matplotlib", "FAIL"), ("ipywidgets", "FAIL"),
                      ("ipykernel", "FAIL"), ("jupyterlab", "warn"), ("deepspeed", "FAIL"), ("nbval", "warn")):
        v = _version(pkg)
        why = {"deepspeed": "lessons " + ", ".join(DEEPSPEED_LESSONS) + " need it (pip install -e '.[dist]')",
               "jupyterlab": "open the notebooks another way (VS Code, JupyterHub)",
               "nbval": "make test-notebooks needs it"}.get(pkg, "the notebooks need it")
        checks.append(Check(pkg, "ok" if v else need, v or f"not installed: {why}"))
    cores = os.cpu_count() or 1
    checks.append(Check("cpu cores", "ok" if cores >= 2 else "warn",
                        f"{cores}" + ("" if cores >= 2
                                      else ": the two ranks of the multi-rank lessons share one core (slow)")))
    ram = _ram_bytes()
    ram_ok = ram and ram >= MIN_RAM
    checks.append(Check("ram", "ok" if ram_ok else "warn",
                        (fmt_bytes(ram) if ram else "unknown")
                        + ("" if ram_ok else f"; keep {fmt_bytes(MIN_RAM)} free for a kernel and two ranks")))
    gpus = 0
    try:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for i in range(gpus):
            f = gpu_facts(torch.cuda.get_device_properties(i))
            checks.append(Check(f"gpu {i}", "ok", f"{f.name}, {fmt_bytes(f.memory)}, capability "
                                f"{f.capability}, bf16 {'native' if f.bf16_native else 'emulated/slow'}"))
        if gpus == 0:
            checks.append(Check("gpu", "ok", f"none (torch {torch.__version__}, CUDA "
                                f"{torch.version.cuda or 'not built'}): every lesson runs on the CPU"))
    except ImportError:
        pass
    if _version("torch") and _version("deepspeed"):
        checks.append(check_cpu_adam() if build else
                      Check("deepspeed cpu_adam", "ok", "not built (--no-build); cache: "
                            + os.environ.get("TORCH_EXTENSIONS_DIR", "~/.cache/torch_extensions")))
        checks.append(check_two_ranks())
    return checks, lesson_places(gpus)


#: the dtypes the calibration times, by memlab's names
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``name`` (:data:`DTYPES`); InputError names the allowed ones."""
    if name not in DTYPES:
        raise InputError(f"dtype={name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


def fastest_seconds(fn, device: torch.device, repeats: int) -> float:
    """Seconds of the fastest of ``repeats + 1`` calls of ``fn`` (the first also warms up),
    the device's queue drained around each (a CUDA kernel's time, not its launch)."""
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def linear_training_gemms(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor) -> None:
    """The three GEMMs a Linear without bias costs in a training step, in the layouts autograd
    runs them: forward ``y = x w^T``, backward ``dx = dy w`` and ``dw = dy^T x``: ``6 m k n``
    FLOPs for ``x`` of ``m x k`` and ``w`` of ``n x k``. ``x`` and ``w`` need ``requires_grad``."""
    torch.nn.functional.linear(x, w).backward(grad)


def measure_matmul_flops(dtype: str = "fp32", device: str = "cpu", n: int | None = None,
                         repeats: int = 3, shape: tuple[int, int, int] | None = None) -> float:
    """FLOP/s of a training step's matmuls in ``dtype`` on ``device``: a Linear's forward and
    backward (:func:`linear_training_gemms`), the best of ``repeats`` after a warm-up.

    Timed as a step runs them rather than as one square ``a @ b``: on a CPU without native
    bf16 the backward's layouts run an order of magnitude slower than the forward's
    (measured on an AVX2 host: a bf16 ``x w^T`` at ~16 GFLOP/s, ``dy w`` at ~1.2), so one
    square matmul misjudges a bf16 step there several times over.

    Args:
        dtype: ``fp32``, ``bf16`` or ``fp16``.
        device: ``cpu`` or ``cuda``.
        n: the square shape's side (default 4096 on a GPU, 1024 on the CPU).
        repeats: timed runs after one warm-up.
        shape: ``(m, k, n)`` instead: ``m`` tokens through a ``k -> n`` Linear.

    Returns:
        FLOP/s (``6 m k n`` over the fastest run).
    """
    dev = torch.device(device)
    side = n or (4096 if dev.type == "cuda" else 1024)
    m, k, n_out = shape or (side, side, side)
    kw = {"device": dev, "dtype": torch_dtype(dtype)}
    x = torch.randn(m, k, **kw, requires_grad=True)
    w = torch.randn(n_out, k, **kw, requires_grad=True)
    grad = torch.randn(m, n_out, **kw)

    def once() -> None:
        x.grad = w.grad = None
        linear_training_gemms(x, w, grad)

    return 6 * m * k * n_out / fastest_seconds(once, dev, repeats)


def measure_attention_flops(dtype: str = "fp32", device: str = "cpu",
                            shape: tuple[int, int, int, int] | None = None, repeats: int = 3) -> float:
    """FLOP/s of causal SDPA's forward and backward in ``dtype`` on ``device``, its FLOPs counted
    by torch's ``FlopCounterMode`` (the full ``s x s`` square, as :mod:`memlab.time.flops` counts the
    attention term, so the rate already holds what causality skips).

    Args:
        dtype: ``fp32``, ``bf16`` or ``fp16``.
        device: ``cpu`` or ``cuda``.
        shape: ``(batch, heads, seq, head_dim)`` (default: 4 x 16 x 2048 x 128 on a GPU,
            8 x 4 x 256 x 64 on the CPU).
        repeats: timed runs after one warm-up.

    Returns:
        FLOP/s over the fastest run.
    """
    dev = torch.device(device)
    b, h, s, d = shape or ((4, 16, 2048, 128) if dev.type == "cuda" else (8, 4, 256, 64))
    kw = {"device": dev, "dtype": torch_dtype(dtype)}
    q, k, v = (torch.randn(b, h, s, d, **kw, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, d, **kw)

    def once() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:  # the CPU's kernel too
        once()
    return counter.get_total_flops() / fastest_seconds(once, dev, repeats)


def measure_elementwise(dtype: str = "fp32", device: str = "cpu", shape: tuple[int, int] | None = None,
                        repeats: int = 3) -> ElementwiseRates:
    """How fast ``device`` runs a step's elementwise work in ``dtype``: the bytes per second of
    ``torch.add`` into a third tensor (two reads and a write per element: a streaming op), and
    the elements per second of tanh-GELU's forward and backward (``gelu``, ``gelu_backward``),
    which a CPU computes rather than streams (:mod:`memlab.time.elementwise`).

    Args:
        dtype: ``fp32``, ``bf16`` or ``fp16``.
        device: ``cpu`` or ``cuda``.
        shape: ``(rows, width)`` of the tensors (default 8192 x 8192 on a GPU, 2048 x 1024 on
            the CPU); a step's own activations are ``(tokens, d_model)`` and, for GELU,
            ``(tokens, hidden)``.
        repeats: timed runs after one warm-up.

    Returns:
        :class:`memlab.time.step_time.ElementwiseRates`.
    """
    dev = torch.device(device)
    rows, width = shape or ((8192, 8192) if dev.type == "cuda" else (2048, 1024))
    kw = {"device": dev, "dtype": torch_dtype(dtype)}
    a, b, out = torch.randn(rows, width, **kw), torch.randn(rows, width, **kw), torch.empty(rows, width, **kw)
    size = a.numel() * a.element_size()
    add = fastest_seconds(lambda: torch.add(a, b, out=out), dev, repeats)

    def gelu() -> None:
        torch.nn.functional.gelu(a, approximate="tanh")
        torch.ops.aten.gelu_backward(b, a, approximate="tanh")

    return ElementwiseRates(3 * size / add, 2 * a.numel() / fastest_seconds(gelu, dev, repeats))


def measure_cpu_adam(params: int = 2**24, repeats: int = 3) -> float:
    """Parameters per second of one ``torch.optim.AdamW`` step on the host (what ZeRO-Offload
    runs there in memlab's config, ``torch_adam``), over ``params`` fp32 parameters."""
    p = torch.nn.Parameter(torch.zeros(params))
    p.grad = torch.ones(params)
    opt = torch.optim.AdamW([p], lr=1e-4)
    opt.step()  # the moments exist from here on
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - start)
    return params / best


def calibrate(path: "pathlib.Path | None" = None) -> Calibration:
    """``memlab doctor --calibrate``: a Linear's training matmuls, causal attention and the
    elementwise rates (:func:`measure_elementwise`) per dtype on this machine's GPU (its card
    profile's name) or CPU (``"cpu"``), and the host's AdamW throughput; written to
    :func:`memlab.time.step_time.calibration_path` (or ``path``) for the step-time model."""
    card = detect_card()
    device, name = ("cuda", card.name) if card is not None else ("cpu", "cpu")
    dtypes = ("fp32", "bf16", "fp16") if device == "cuda" else ("fp32", "bf16")
    elementwise = {d: measure_elementwise(d, device) for d in dtypes}
    cal = Calibration(name, {d: measure_matmul_flops(d, device) for d in dtypes}, measure_cpu_adam(),
                      {d: measure_attention_flops(d, device) for d in dtypes},
                      {d: r.bytes_per_s for d, r in elementwise.items()},
                      {d: r.activation_elements_per_s for d, r in elementwise.items()})
    target = path or calibration_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(asdict(cal), indent=1))
    return cal


def main(argv: list[str] | None = None) -> int:
    """``memlab doctor``: print the checks and the verdict; 1 when something blocks the workbook.
    ``--calibrate`` also measures a Linear's training matmuls, attention, elementwise rates and the
    host's Adam for the step-time model."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--calibrate" in argv:
        cal = calibrate()
        rates = ", ".join(f"{d} {f / 1e12:.3g} TFLOP/s" for d, f in cal.matmul_flops.items())
        attn = ", ".join(f"{d} {f / 1e12:.3g} TFLOP/s" for d, f in cal.attention_flops.items())
        ew = ", ".join(f"{d} {b / 1e9:.3g} GB/s, GELU {cal.activation_elements[d] / 1e9:.3g} G elements/s"
                       for d, b in cal.elementwise_bytes.items())
        print(f"calibrated {cal.device}: matmul {rates}; attention {attn}; elementwise {ew}; host AdamW "
              f"{cal.cpu_adam_params_per_s / 1e6:.0f}M params/s")
    checks, places = collect(build="--no-build" not in argv)
    blocked = [f"{c.name}: {c.detail}" for c in checks if c.status == "FAIL"]
    line = verdict(places, blocked)
    if "--json" in argv:
        print(json.dumps({"checks": [asdict(c) for c in checks], "lessons": places, "verdict": line}, indent=1))
    else:
        print("\n".join(str(c) for c in checks))
        print(line)
    return 1 if blocked else 0


if __name__ == "__main__":
    sys.exit(main())
