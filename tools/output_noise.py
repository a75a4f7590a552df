"""Noise in a notebook cell's outputs: what a learner has to read past.

A lesson's outputs should hold what it teaches and nothing else. :func:`noise_in` reads one
cell's outputs (nbformat's output dicts, as nbval collects them or as an executed notebook
stores them) and names each piece of noise, by kind:

- ``error``: a traceback (an error output, or "Traceback (most recent call last)" in a stream)
- ``warning``: anything on stderr that is not a progress bar or build output, or text like
  ``FutureWarning:`` / ``[WARNING]`` anywhere
- ``progress``: a tqdm bar left in the output (``  0%|          | 0/4``), on a stream or as a
  progress widget's text
- ``build``: DeepSpeed / torch extension build output (ninja, the compiler, ``/usr/bin/ld``)
- ``repr``: a raw dataclass or dict repr longer than :data:`REPR_WIDTH` characters on one line
  (``AccumulationCheck(max_abs_diff=1.7881393432617188e-07, ...)``), or a float printed with
  all its 16 digits

A cell tagged ``allow-<kind>`` (e.g. ``allow-warning``, for a lesson that prints the deprecation
warnings it is about) is not checked for that kind. ``notebooks/conftest.py`` fails every nbval
cell with noise; ``python tools/output_noise.py NB.ipynb ...`` counts it in executed notebooks.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from dataclasses import dataclass

KINDS = ("error", "warning", "progress", "build", "repr")
#: the longest line a raw repr may take before it is noise (a notebook's text column)
REPR_WIDTH = 120

#: tqdm's bar: "measure seq:   0%|          | 0/4 [00:00<?, ?it/s]"
#: and without a total: "batch search: 0it [00:00, ?it/s]"
PROGRESS = re.compile(r"\d{1,3}%\|[^|\n]*\|\s*\d+(\.\d+)?[kMG]?/|\b\d+(\.\d+)?[kMG]?(it|B) \[\d+:\d\d")
#: Python's warnings ("FutureWarning: ..."), loggers' levels ("[WARNING]", "WARNING:")
WARNING = re.compile(r"\b\w+Warning: |\[WARNING\]|^\s*WARNING[:\s]|\bwarnings\.warn\(", re.M)
TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
#: a traceback's last line: "ValueError: ...", "torch.OutOfMemoryError: ..."
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b")
#: DeepSpeed's op builder, torch.utils.cpp_extension, ninja, the compiler and the linker
BUILD = re.compile("|".join([
    r"/usr/bin/ld\b", r"\bcannot find -l\w+", r"collect2: error", r"\bninja: ", r"^\[\d+/\d+\] ",
    r"Emitting ninja build file", r"Building extension module", r"Loading extension module",
    r"Allowing ninja to set a default number of workers", r"as PyTorch extensions root",
    r"Creating extension directory", r"Time to load \w+ op", r"\b(c\+\+|g\+\+|gcc|nvcc) .*-c ",
    r"async_io requires the dev libaio", r"op_builder", r"\bbuilt successfully\b(?! in)",
]), re.M)
#: a dataclass's repr "Name(field=" or a dict's "{'key': " at the start of a line
RAW_REPR = re.compile(r"^\s*(\w+\.)*[A-Z]\w*\(\w+=|^\s*\{['\"\w]+['\"]?: ")
#: a float with all of repr's digits: 0.2488566398040607, 1.7881393432617188e-07
LONG_FLOAT = re.compile(r"(?<![\w.])-?\d+\.\d{12,}(e[+-]?\d+)?\b")


@dataclass(frozen=True)
class Noise:
    """One piece of noise in a cell's outputs: its ``kind`` (one of :data:`KINDS`) and the
    line it is on (``excerpt``, cut to 160 characters)."""
    kind: str
    excerpt: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.excerpt}"


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value or "")


def _cut(line: str) -> str:
    line = line.strip()
    return line if len(line) <= 160 else line[:157] + "..."


def _line_kind(line: str, stderr: bool) -> str | None:
    """The kind of noise one output line is, or None."""
    if TRACEBACK.search(line):
        return "error"
    if PROGRESS.search(line):
        return "progress"
    if BUILD.search(line):
        return "build"
    if WARNING.search(line) or (stderr and line.strip()):
        return "warning"
    if (len(line) > REPR_WIDTH and RAW_REPR.search(line)) or LONG_FLOAT.search(line):
        return "repr"
    return None


def _last_frame(text: str) -> str:
    """What a terminal (or a page) finally shows of a stream that redraws with ``\\r``."""
    return "\n".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n"))


def _text_noise(text: str, stderr: bool = False) -> list[Noise]:
    found: list[Noise] = []
    in_traceback = False
    for line in _last_frame(text).splitlines():
        # a traceback runs to its exception's line, a warning's indented source line follows
        # it on stderr: one block, one piece of noise
        if in_traceback:
            in_traceback = not EXCEPTION_LINE.match(line)
            continue
        if stderr and found and line[:1].isspace() and found[-1].kind == "warning":
            continue
        kind = _line_kind(line, stderr)
        if kind is not None:
            found.append(Noise(kind, _cut(line)))
            in_traceback = kind == "error"
    return found


def noise_in(outputs: list[dict], tags: tuple[str, ...] | list[str] = ()) -> list[Noise]:
    """The noise in one cell's ``outputs`` (nbformat output dicts), in output order.

    Args:
        outputs: the cell's outputs (``stream``, ``display_data``, ``execute_result``, ``error``).
        tags: the cell's tags; ``allow-<kind>`` skips that kind.
    Returns:
        One :class:`Noise` per noisy line or block (empty for a quiet cell).
    """
    found: list[Noise] = []
    for out in outputs:
        kind = out.get("output_type")
        if kind == "error":
            found.append(Noise("error", _cut(f"{out.get('ename')}: {_text(out.get('evalue'))}")))
        elif kind == "stream":
            found += _text_noise(_text(out.get("text")), stderr=out.get("name") == "stderr")
        elif kind in ("display_data", "execute_result"):
            data = out.get("data", {})
            text = _text(data.get("text/plain"))
            if "application/vnd.jupyter.widget-view+json" in data:
                # a widget's text/plain is its fallback (the site shows it): only a bar counts
                found += [n for n in _text_noise(text) if n.kind == "progress"]
            else:
                found += _text_noise(text)
    allowed = {t[len("allow-"):] for t in tags if t.startswith("allow-")}
    return [n for n in found if n.kind not in allowed]


def count_notebook(path: str) -> collections.Counter:
    """Pieces of noise by kind in an executed notebook at ``path`` (every code cell's outputs)."""
    import nbformat
    nb = nbformat.read(path, as_version=4)
    counts: collections.Counter = collections.Counter()
    for cell in nb.cells:
        if cell.cell_type == "code":
            counts.update(n.kind for n in noise_in(cell.get("outputs", []), cell.metadata.get("tags", ())))
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="count the noise in executed notebooks' outputs")
    parser.add_argument("notebooks", nargs="+")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each piece of noise")
    args = parser.parse_args(argv)
    noisy = 0
    print(f"{'notebook':<44}" + "".join(f"{k:>10}" for k in KINDS))
    for path in args.notebooks:
        counts = count_notebook(path)
        noisy += sum(counts.values()) > 0
        print(f"{path.rsplit('/', 1)[-1]:<44}" + "".join(f"{counts[k]:>10}" for k in KINDS))
        if args.verbose:
            import nbformat
            for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
                for n in noise_in(cell.get("outputs", []), cell.metadata.get("tags", ())):
                    print(f"    cell {i} {n}")
    return 1 if noisy else 0


if __name__ == "__main__":
    sys.exit(main())
