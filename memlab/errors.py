"""The errors memlab raises for its users (the CLI maps them to exit status 2).

:class:`InputError` is bad input: a value outside what is allowed, a flag a command cannot
honour. It subclasses ``ValueError``, so code that catches ``ValueError`` keeps working; the
CLI catches only this type, so an internal ``ValueError`` (a bug) shows its traceback and
exits 1 instead of passing for a user's mistake.
"""
from __future__ import annotations


class InputError(ValueError):
    """Bad user input; the message names the value and what is allowed."""


class HostMemoryError(InputError):
    """A real step that this machine cannot hold, refused before anything was allocated.

    ``need_bytes`` is what the step needs by :mod:`memlab.guard`'s rule, ``available_bytes``
    what ``resource`` (``"host RAM"``, ``"free memory on cuda:0"``) has now; ``way_out`` says
    what to run instead. ``str()`` is one line.
    """

    def __init__(self, need_bytes: int, available_bytes: int, resource: str, rule: str,
                 way_out: str = "simulate it instead (`memlab simulate` with the same flags, or "
                                "memlab.simulate.simulate_step) or choose a smaller model, "
                                "sequence or batch"):
        self.need_bytes, self.available_bytes = int(need_bytes), int(available_bytes)
        self.resource, self.rule, self.way_out = resource, rule, way_out
        super().__init__(self._line())

    def _line(self) -> str:
        from .hardware import fmt_bytes
        return (f"measuring this step needs about {fmt_bytes(self.need_bytes)} of {self.resource} "
                f"({self.rule}) but only {fmt_bytes(self.available_bytes)} is available; "
                f"{self.way_out}")

    def with_way_out(self, way_out: str) -> "HostMemoryError":
        """The same refusal with another way out (the CLI names the exact command)."""
        return HostMemoryError(self.need_bytes, self.available_bytes, self.resource, self.rule,
                               way_out)


__all__ = ["InputError", "HostMemoryError"]
