"""memlab in the learner's own run: a ``transformers`` ``TrainerCallback`` and a context manager
for a plain training loop.

Both track the first ``steps`` optimizer steps by category with :class:`~memlab.tracking.tracker.
MemoryTracker` (the tracker :func:`memlab.lenses.your_model.track_step` uses, so a step's report here
equals ``track_step``'s of the same step), record the CUDA allocator's history on a GPU
(``torch.cuda.memory._record_memory_history``; the snapshot is written for
pytorch.org/memory_viz after the tracked steps and again at an OOM), and on an out-of-memory
error print memlab's explanation (:func:`memlab.tracking.oom_messages.explain_oom`) beside the traceback.

A Hugging Face ``Trainer``::

    from memlab.hf.callbacks import MemoryCallback      # imports transformers
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[MemoryCallback(steps=2)])
    trainer.train()
    print(trainer.callback_handler.callbacks[-1].reports[-1].table())

A plain loop::

    with memory_watch(model, opt, steps=2) as watch:
        for batch in loader:
            with watch.step():
                model(**batch).loss.backward(); opt.step(); opt.zero_grad()
    print(watch.reports[-1].table())

``transformers`` is imported only when ``MemoryCallback`` is first used: this module is
importable without it.
"""
from __future__ import annotations

import builtins
import contextlib
import sys
import time
from typing import IO, Iterator

import torch
import torch.nn as nn

from memlab.core.errors import InputError
from memlab.core.hardware import resolve_budget
from memlab.core.torch_private import dump_memory_snapshot, record_memory_history, stop_memory_history
from memlab.core.units import fmt_bytes
from memlab.lenses.measure import add_workspace
from memlab.lenses.your_model import model_step
from memlab.step.training_step import MemoryReport
from memlab.tracking.oom_messages import OOMExplanation, explain_oom
from memlab.tracking.tracker import MemoryTracker, is_host_oom


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or (isinstance(error, RuntimeError) and is_host_oom(error))


class StepWatch:
    """Tracks the first ``steps`` steps of a run; what :func:`memory_watch` yields and what
    :class:`MemoryCallback` drives. ``reports`` holds one :class:`~memlab.step.training_step.MemoryReport`
    per tracked step; ``explanation`` the explained OOM, if one happened.

    Args:
        steps: how many steps to track from the first (the first creates the optimizer
            state; the second is the steady state).
        budget: bytes, a size string or a GPU preset: the tracker refuses the op that
            crosses it, as :func:`~memlab.lenses.your_model.track_step` does on CPU.
        snapshot_path: CUDA only: where to write the allocator history (.pickle).
        stream: where explanations go (default ``sys.stderr``).
    """

    def __init__(self, steps: int = 1, *, budget: int | str | None = None,
                 snapshot_path: str | None = None, stream: IO[str] | None = None):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise InputError(f"steps must be a whole number >= 0, got {steps!r}")
        self.steps = steps
        self.budget_bytes = resolve_budget(budget)
        self.snapshot_path = snapshot_path
        self.stream = stream
        #: the optimizer a plain loop's ``step()`` counts (memory_watch's)
        self.optimizer = None
        self.reports: list[MemoryReport] = []
        self.explanation: OOMExplanation | None = None
        self._tracker: MemoryTracker | None = None
        self._model: nn.Module | None = None
        self._start = 0.0
        self._before = 0
        self._recording = False

    # -- the CUDA allocator's history ----------------------------------------------------
    def start(self, model: nn.Module | None = None) -> None:
        """Begin recording the CUDA allocator's history (CUDA and a ``snapshot_path`` only)."""
        self._model = model if model is not None else self._model
        if self.snapshot_path and torch.cuda.is_available() and not self._recording:
            record_memory_history(max_entries=100_000)
            self._recording = True

    def dump(self) -> str | None:
        """Write the allocator history recorded so far to ``snapshot_path``; its path, or None."""
        if not self._recording:
            return None
        dump_memory_snapshot(self.snapshot_path)
        return self.snapshot_path

    def close(self) -> None:
        """Leave a step still tracked (after an error) and stop recording."""
        if self._tracker is not None:
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)
        if self._recording:
            stop_memory_history()
            self._recording = False

    # -- one step ------------------------------------------------------------------------
    @property
    def tracking(self) -> bool:
        """Whether a step is being tracked now."""
        return self._tracker is not None

    def begin(self, model: nn.Module, optimizer=None) -> bool:
        """Start tracking a step if fewer than ``steps`` were; returns whether it does."""
        if self._tracker is not None or len(self.reports) >= self.steps:
            return False
        self._model = model
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        tracker = MemoryTracker(self.budget_bytes, cuda=device.type == "cuda", device=device)
        tracker.__enter__()
        tracker.track_model(model)
        if optimizer is not None:
            tracker.track_optimizer(optimizer)
        tracker.reset_peak()
        self._tracker, self._before, self._start = tracker, tracker.live_bytes, time.perf_counter()
        return True

    def end(self) -> MemoryReport | None:
        """Finish the tracked step: its report (appended to ``reports``), or None."""
        tracker = self._tracker
        if tracker is None:
            return None
        if tracker.device is not None and tracker.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self._start
        self._tracker = None
        tracker.__exit__(None, None, None)
        report = add_workspace(MemoryReport(
            "measure", model_step(self._model), tracker.device.type if tracker.device else "cpu",
            tracker.peak_bytes, tracker.peak_by_category(), self.budget_bytes, seconds, tracker.oom,
            tracker.timeline, tracker.cuda_stats, self._before, tracker.live_bytes,
            host_bytes=tracker.host_peak_bytes, host_by_category=tracker.host_peak_by_category()))
        self.reports.append(report)
        if len(self.reports) == self.steps:
            self.dump()
        return report

    @contextlib.contextmanager
    def step(self, optimizer=None) -> Iterator[None]:
        """One step of a plain loop: tracked while fewer than ``steps`` were."""
        if self._model is None:
            raise InputError("memory_watch(model, ...) names the model a step trains")
        self.begin(self._model, optimizer if optimizer is not None else self.optimizer)
        try:
            yield
        except BaseException as error:
            self.fail(error)
            raise
        self.end()

    # -- an out-of-memory error ----------------------------------------------------------
    def fail(self, error: BaseException) -> OOMExplanation | None:
        """After an error: leave the tracked step, and for an OOM write the snapshot and print
        memlab's explanation (kept in ``explanation``). Other errors are left alone."""
        tracker = self._tracker
        if tracker is not None:
            self._tracker = None
            tracker.__exit__(type(error), error, error.__traceback__)
        if not _is_oom(error) or self.explanation is not None:
            return self.explanation
        path = self.dump()
        try:
            explanation = explain_oom(str(error))
        except InputError:  # an OOM whose text memlab does not read: say what the tracker saw
            explanation = None
        if tracker is not None and tracker.oom is not None:
            oom = tracker.oom
            line = (f"memlab's tracker at the failing op: {oom.op} in {oom.module} ({oom.phase}), "
                    f"{fmt_bytes(oom.live_bytes)} live; largest category {oom.culprit}: "
                    + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in oom.by_category.items() if v))
            if explanation is not None:
                explanation.lines.append(line)
            else:
                print(line, file=self.stream or sys.stderr)
        if explanation is not None:
            if path:
                explanation.lines.append(f"allocator history written to {path} (pytorch.org/memory_viz)")
            print(explanation.table(), file=self.stream or sys.stderr)
        self.explanation = explanation
        return explanation


@contextlib.contextmanager
def memory_watch(model: nn.Module, optimizer=None, *, steps: int = 1, budget: int | str | None = None,
                 snapshot_path: str | None = None, stream: IO[str] | None = None) -> Iterator[StepWatch]:
    """A plain training loop, watched: ``with watch.step():`` around each step tracks the
    first ``steps`` of them; an OOM anywhere in the block is explained, then re-raised.

    Args:
        model: the model the loop trains.
        optimizer: its optimizer (its state is counted from the start of a tracked step).
        steps, budget, snapshot_path, stream: as :class:`StepWatch`.
    Returns:
        the :class:`StepWatch` (its ``reports`` fill as steps end).
    """
    watch = StepWatch(steps, budget=budget, snapshot_path=snapshot_path, stream=stream)
    watch.optimizer = optimizer
    watch.start(model)
    try:
        yield watch
    except BaseException as error:
        watch.fail(error)
        raise
    finally:
        watch.close()


def _make_callback_class() -> type:
    from transformers import TrainerCallback  # the edge: only a Trainer's user needs it

    class MemoryCallback(TrainerCallback):
        """A ``transformers.TrainerCallback``: the first ``steps`` optimizer steps tracked by
        category (``reports``), the CUDA allocator's history recorded (``snapshot_path``), and
        an OOM that ends ``trainer.train()`` explained before its traceback (through
        ``sys.excepthook``, or IPython's handler in a notebook, while training runs).

        Args: as :class:`StepWatch` (``steps=2`` reaches the steady state).
        """

        def __init__(self, steps: int = 1, *, budget: int | str | None = None,
                     snapshot_path: str | None = None, stream: IO[str] | None = None):
            self.watch = StepWatch(steps, budget=budget, snapshot_path=snapshot_path, stream=stream)
            self._hook = None
            self._ipython = None

        @property
        def reports(self) -> list[MemoryReport]:
            return self.watch.reports

        @property
        def explanation(self) -> OOMExplanation | None:
            return self.watch.explanation

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.watch.start(model)
            self._install()

        def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            # Trainer's optimizer is accelerate's wrapper; the tracker reads the real one
            self.watch.begin(model, getattr(optimizer, "optimizer", optimizer))

        def on_step_end(self, args, state, control, **kwargs):
            self.watch.end()

        def on_train_end(self, args, state, control, **kwargs):
            self.close()

        def close(self) -> None:
            """Stop tracking and recording; remove the OOM hook."""
            self.watch.close()
            if self._hook is not None and sys.excepthook is self._hook:
                sys.excepthook = self._previous
            self._hook = None
            if self._ipython is not None:
                self._ipython.set_custom_exc((), None)
                self._ipython = None

        def handle(self, error: BaseException) -> OOMExplanation | None:
            """What the hook does with an error that ended training: the explanation."""
            explanation = self.watch.fail(error)
            self.close()
            return explanation

        def _install(self) -> None:
            previous = sys.excepthook

            def hook(etype, value, tb):
                previous(etype, value, tb)
                self.handle(value)

            self._previous, self._hook = previous, hook
            sys.excepthook = hook
            # IPython puts get_ipython in builtins inside a kernel or shell: no import needed
            shell = getattr(builtins, "get_ipython", lambda: None)()
            if shell is not None and hasattr(shell, "set_custom_exc"):
                def ipython_handler(shell, etype, value, tb, tb_offset=None):
                    shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
                    self.handle(value)

                shell.set_custom_exc((torch.OutOfMemoryError, RuntimeError), ipython_handler)
                self._ipython = shell

    return MemoryCallback


_CLASSES: dict[str, type] = {}


def __getattr__(name: str):
    """``MemoryCallback`` is built on first use, importing ``transformers`` then."""
    if name == "MemoryCallback":
        if name not in _CLASSES:
            _CLASSES[name] = _make_callback_class()
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MemoryCallback", "StepWatch", "memory_watch"]  # noqa: F822 (MemoryCallback: __getattr__)
