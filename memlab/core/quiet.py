"""Quiet outputs: progress bars only where someone watches, library build output in one line.

A lesson's outputs are read later, on the site or in a notebook nbval ran: a progress bar
there is frozen at its first frame (``0%|``), and a DeepSpeed op's JIT build leaves pages of
ninja, compiler and linker lines. Two helpers keep them out:

- :func:`progress_wanted`: whether memlab shows a bar. ``MEMLAB_PROGRESS=0`` (set by
  ``notebooks/conftest.py`` for nbval and by ``tools/make_site.py``) turns them off, ``=1``
  on; unset, a bar shows in a live Jupyter kernel or on a terminal, nowhere else.
- :func:`quiet_build`: runs a block with the process's stdout and stderr *file descriptors*
  sent to a file (the build's output comes from ninja and the compiler, subprocesses that
  write to the descriptors, past ``sys.stdout``), then prints one line when it built an op:
  ``DeepSpeed op cpu_adam: built in 41 s (cached under .cache/torch_extensions)``; the whole
  log is printed only when the block fails. :func:`build_line` gives the same line for ranks
  (:func:`memlab.distributed.ranks.run_ranks` keeps their output in a log).

- :func:`quiet_offline_kernels`: bitsandbytes' CPU backend, on a CPU with AVX512-BF16, tries
  to fetch a 4-bit GEMM from the Hugging Face hub (``kernels-community``) when it is imported
  (by peft, by transformers) and logs a warning when it cannot; memlab's machines have no hub
  and nothing of memlab runs that kernel, so memlab keeps that one logger to errors. torchao,
  which ``transformers`` imports when it is installed, logs a warning for each of its CUDA
  extension libraries that does not load (every one, on a CPU-only torch), and its import
  registers enums with torch's pytree, which logs a deprecation warning per enum
  (``torch/utils/_pytree.py``, ``register_constant``); neither is anything memlab or a lesson
  uses, so those two loggers are kept to errors as well.

And one for results: :class:`OneLine`, a mixin for the dataclasses a lesson prints or ends a
cell with. Their ``__str__`` is one readable line of what matters (sizes in MiB/GiB, floats
cut to their meaningful digits); the mixin makes IPython show that line too, where it would
print the dataclass's whole ``repr``. ``repr``, the fields and equality stay the dataclass's.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import time
from typing import Iterator

#: the environment variable that turns memlab's progress bars off ("0") or on ("1")
PROGRESS_ENV = "MEMLAB_PROGRESS"
_OFF = ("0", "false", "no", "off")


#: loggers that warn of kernels this machine cannot load: bitsandbytes' CPU backend (its hub
#: kernel), torchao (its CUDA extensions) and torch's pytree (enums torchao registers)
OFFLINE_KERNEL_LOGGERS = ("bitsandbytes.backends.cpu.ops", "torchao", "torch.utils._pytree")


def quiet_offline_kernels() -> None:
    """Keep the loggers of :data:`OFFLINE_KERNEL_LOGGERS` to errors (see the module doc); the
    level set before bitsandbytes is imported holds when it creates the logger."""
    for name in OFFLINE_KERNEL_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (IPython's ``ZMQInteractiveShell``)."""
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    ip = shell.get_ipython()
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def progress_wanted(asked: bool | None = None) -> bool:
    """Whether to show a progress bar.

    Args:
        asked: the caller's explicit choice; None decides from the environment.
    Returns:
        ``asked`` when given; else False when :data:`PROGRESS_ENV` is ``0`` (nbval, the site),
        True when it is ``1``; else True in a Jupyter kernel or on a terminal.
    """
    if asked is not None:
        return bool(asked)
    env = os.environ.get(PROGRESS_ENV)
    if env is not None and env.strip():
        return env.strip().lower() not in _OFF
    return in_kernel() or bool(getattr(sys.stderr, "isatty", lambda: False)())


def _pretty_str(self, p, cycle: bool) -> None:
    p.text(repr(self) if cycle else str(self))


class OneLine:
    """Mixin: IPython's display of the object is ``str(self)`` (the class's one readable line),
    not its ``repr`` (every field, every digit), which stays for debugging."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # IPython takes the first class in the MRO with _repr_pretty_ or __repr__ in its own
        # __dict__, and @dataclass writes __repr__ into the subclass's: so it goes there too
        cls._repr_pretty_ = _pretty_str


def extensions_dir() -> str:
    """Where torch (and DeepSpeed) cache JIT-built ops: ``TORCH_EXTENSIONS_DIR`` or torch's
    default, relative to the working directory when it is under it."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    try:
        rel = os.path.relpath(root)
    except ValueError:   # another drive (Windows)
        return root
    return rel if not rel.startswith("..") else root


def built_ops() -> dict[str, float]:
    """Each op cached in :func:`extensions_dir` (the folder of its ``.so``) and when it was built."""
    found: dict[str, float] = {}
    root = extensions_dir()
    if not os.path.isdir(root):
        return found
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".so"):
                found[os.path.basename(folder)] = max(found.get(os.path.basename(folder), 0.0),
                                                      os.path.getmtime(os.path.join(folder, f)))
    return found


def build_line(before: dict[str, float], start: float, what: str = "DeepSpeed op") -> str | None:
    """One line for the ops built since ``before`` (:func:`built_ops`) was taken at ``start``
    (``time.time()``), or None when none was (each was loaded from the cache)."""
    new = {op: t for op, t in built_ops().items() if t > before.get(op, 0.0)}
    if not new:
        return None
    seconds = max(new.values()) - start
    return f"{what} {', '.join(sorted(new))}: built in {max(seconds, 0):.0f} s (cached under {extensions_dir()})"


class _Sink(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` inside :func:`quiet_build`: keeps what is written while the
    block runs (for the failure log) and drops what comes after. A logging handler made in the
    block binds to it for good (DeepSpeed's, on ``sys.stdout`` at its first import): its later
    lines stay out of a lesson and out of ``--json``'s stdout, as they did when the block
    redirected to a ``StringIO``. ``fileno`` is the descriptor it stands for, which DeepSpeed's
    op probes redirect around the compiler."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd, self.parts, self.active = fd, [], True

    def write(self, text: str) -> int:
        if self.active:
            self.parts.append(text)
        return len(text)

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.fd


@contextlib.contextmanager
def quiet_build(what: str = "DeepSpeed op", *, stream=None) -> Iterator[None]:
    """Run the block with its output, to ``sys.stdout``/``sys.stderr`` and to file descriptors
    1 and 2 (the compiler and linker, subprocesses), sent to a log; then print one line when
    it built an op (:func:`build_line`), nothing when every op came from the cache.

    Args:
        what: what is built, for the line (``"DeepSpeed op"``).
        stream: where the line goes (``sys.stdout`` as it was before the block).
    Yields:
        Nothing; on an exception the log is printed to ``sys.stderr`` and the exception raised.
    """
    out = sys.stdout if stream is None else stream
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    before, start = built_ops(), time.time()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    sinks = (_Sink(1), _Sink(2))
    with tempfile.TemporaryFile(mode="w+b") as log:
        ok = False
        try:
            for fd in (1, 2):
                os.dup2(log.fileno(), fd)
            with contextlib.redirect_stdout(sinks[0]), contextlib.redirect_stderr(sinks[1]):
                yield
            ok = True
        finally:
            for sink in sinks:
                sink.active = False
            for fd, keep in saved.items():
                os.dup2(keep, fd)
                os.close(keep)
            if ok:
                line = build_line(before, start, what)
                if line:
                    print(line, file=out)
            else:
                log.seek(0)
                text = "".join(sinks[0].parts + sinks[1].parts) + log.read().decode("utf-8", "replace")
                print(f"{what}: failed; its output:\n{text}", file=sys.stderr)


__all__ = ["OneLine", "PROGRESS_ENV", "in_kernel", "progress_wanted", "extensions_dir",
           "built_ops", "build_line", "quiet_build"]
