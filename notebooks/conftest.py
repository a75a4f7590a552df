"""nbval, quietly: a lesson cell whose outputs hold noise fails.

Picked up by every pytest run that collects notebooks/ (``pytest --nbval notebooks/``, ``make
test``'s nbval run, ``make gpu-check``). After nbval has run a cell and compared nothing (the
notebooks are committed stripped), this reads the outputs it collected (``IPyNbCell.test_outputs``)
and fails the cell on a traceback, a warning, a progress bar, DeepSpeed build output or a raw
repr longer than a line (``tools/output_noise.py`` says what each is; a cell tagged
``allow-<kind>`` may show that kind, e.g. the deprecation warnings lesson 04 is about).

It also registers ``tools/nbval_watchdog.py``: a cell whose kernel sits idle with no reply is
reported in one line and its notebook retried once in a fresh kernel (memlab.classroom.watchdog).

The kernels nbval starts inherit this process's environment: ``MEMLAB_PROGRESS=0`` turns
memlab's progress bars off there (nobody watches them; they would stay at 0%).
"""
from __future__ import annotations

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))
import nbval_watchdog  # noqa: E402
from output_noise import noise_in  # noqa: E402  (tools/ is not a package)


def pytest_configure(config) -> None:
    os.environ["MEMLAB_PROGRESS"] = "0"
    if not config.pluginmanager.is_registered(nbval_watchdog):   # (or given with -p)
        config.pluginmanager.register(nbval_watchdog, "nbval_watchdog")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield
    outputs = getattr(item, "test_outputs", None)
    cell = getattr(item, "cell", None)
    if outputs and cell is not None and hasattr(item, "raise_cell_error"):  # nbval's IPyNbCell
        found = noise_in(outputs, cell.get("metadata", {}).get("tags", ()))
        if found:
            item.raise_cell_error(f"Cell output holds noise ({len(found)}: "
                                  + ", ".join(sorted({n.kind for n in found})) + ")",
                                  "\n".join(f"  {n}" for n in found))
    return result
