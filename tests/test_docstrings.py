"""The front door's names say what they take, return and raise (``import memlab as ml``)."""
import inspect

import pytest

import memlab

PUBLIC = [n for n in memlab.__all__ if inspect.isfunction(getattr(memlab, n)) or inspect.isclass(getattr(memlab, n))]


@pytest.mark.parametrize("name", PUBLIC)
def test_each_public_function_and_class_has_args_returns_raises(name):
    obj = getattr(memlab, name)
    doc = inspect.getdoc(obj) or ""
    if inspect.isfunction(obj):
        assert "\nArgs:\n" in doc and "\nReturns:\n" in doc, f"{name}: an Args: and a Returns: section"
    else:
        assert "\nArgs:\n" in doc or "\nRaises:\n" in doc, f"{name}: an Args: (or Raises:) section"
