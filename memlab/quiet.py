"""Quiet outputs: progress bars only where someone watches, library build output in one line.

A lesson's outputs are read later, on the site or in a notebook nbval ran: a progress bar
there is frozen at its first frame (``0%|``), and a DeepSpeed op's JIT build leaves pages of
ninja, compiler and linker lines. Two helpers keep them out:

- :func:`progress_wanted`: whether memlab shows a bar. ``MEMLAB_PROGRESS=0`` (set by
  ``notebooks/conftest.py`` for nbval and by ``tools/make_site.py``) turns them off, ``=1``
  on; unset, a bar shows in a live Jupyter kernel or on a terminal, nowhere else.
- :func:`quiet_build`: runs a block with the process's stdout and stderr *file descriptors*
  sent to a file (the build's output comes from ninja and the compiler, subprocesses that
  write to the descriptors, past ``sys.stdout``), then prints one line:
  ``DeepSpeed op cpu_adam: built in 41 s (cached under .cache/torch_extensions)``; the whole
  log is printed only when the block fails.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from typing import Iterator

#: the environment variable that turns memlab's progress bars off ("0") or on ("1")
PROGRESS_ENV = "MEMLAB_PROGRESS"
_OFF = ("0", "false", "no", "off")


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


def quiet_libraries() -> None:
    """Turn off the progress bars ``transformers`` and ``huggingface_hub`` draw (loading
    weights, downloads) when :func:`progress_wanted` says nobody watches them."""
    if progress_wanted():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()


def _cache_dir() -> str:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    try:
        rel = os.path.relpath(root)
    except ValueError:   # another drive (Windows)
        return root
    return rel if not rel.startswith("..") else root


@contextlib.contextmanager
def quiet_build(what: str, *, stream=None) -> Iterator[None]:
    """Run the block with file descriptors 1 and 2 sent to a log, then print one line.

    Args:
        what: what is built, for the line (``"DeepSpeed op cpu_adam"``).
        stream: where the line goes (``sys.stdout``).
    Yields:
        Nothing; on an exception the log is printed to ``sys.stderr`` and the exception raised.
    """
    out = sys.stdout if stream is None else stream
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    start = time.perf_counter()
    with tempfile.TemporaryFile(mode="w+b") as log:
        ok = False
        try:
            for fd in (1, 2):
                os.dup2(log.fileno(), fd)
            yield
            ok = True
        finally:
            for s in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    s.flush()
            for fd, keep in saved.items():
                os.dup2(keep, fd)
                os.close(keep)
            seconds = time.perf_counter() - start
            log.seek(0)
            text = log.read().decode("utf-8", "replace")
            if ok:
                built = "built" if ("Building extension" in text or "ninja" in text) else "loaded"
                print(f"{what}: {built} in {seconds:.0f} s (cached under {_cache_dir()})", file=out)
            else:
                print(f"{what}: failed after {seconds:.0f} s; its build log:\n{text}", file=sys.stderr)


__all__ = ["PROGRESS_ENV", "in_kernel", "progress_wanted", "quiet_libraries", "quiet_build"]
