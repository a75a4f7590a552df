"""The errors memlab raises for its users (the CLI maps them to exit status 2).

:class:`InputError` is bad input: a value outside what is allowed, a flag a command cannot
honour. It subclasses ``ValueError``, so code that catches ``ValueError`` keeps working; the
CLI catches only this type, so an internal ``ValueError`` (a bug) shows its traceback and
exits 1 instead of passing for a user's mistake. (A step this machine cannot hold is an
InputError too: :class:`memlab.lenses.guard.HostMemoryError`, raised where that rule lives.)

The lowest module: it imports nothing from memlab, so that every layer can raise it.
"""
from __future__ import annotations


class InputError(ValueError):
    """Bad user input; the message names the value and what is allowed.

    Args:
        message: the value given and what is allowed.
    """


__all__ = ["InputError"]
