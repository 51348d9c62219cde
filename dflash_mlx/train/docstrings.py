"""Documented names of installed Python modules: what the documentation prompts are made of.

The `stdlib` source asks about a module's public functions and classes, round 6's
(`round6`) also about the methods of its classes and turns pure-Python functions into
code to complete. All of them read the same things here: a module's public callables in
name order with their docstrings (deprecated aliases warn on access, silenced), and a
docstring's first paragraph on one line.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from typing import Iterator

__all__ = ["class_methods", "module_members", "summary"]


def summary(doc: str) -> str:
    """A docstring's first paragraph on one line."""
    return doc.strip().split("\n\n")[0].replace("\n", " ").strip()


def module_members(module_name: str) -> Iterator[tuple[str, object, str]]:
    """(attribute, object, docstring) of each public function, builtin and class of the
    module, by attribute name; nothing when the module does not import here."""
    try:
        mod = importlib.import_module(module_name)
    except Exception:
        return
    for attr in sorted(dir(mod)):
        if attr.startswith("_"):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = getattr(mod, attr, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
        yield attr, obj, doc


def class_methods(cls: type) -> Iterator[tuple[str, object, str]]:
    """(name, function, docstring) of each public method the class itself defines (not
    inherited), by name, with the docstring it has there (inherited docstrings count:
    `inspect.getdoc`)."""
    for name in sorted(vars(cls)):
        if name.startswith("_"):
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = getattr(cls, name, None)
            if not any(
                f(obj) for f in (inspect.isfunction, inspect.isbuiltin, inspect.ismethod, inspect.ismethoddescriptor)
            ):
                continue
            doc = inspect.getdoc(obj) or ""
        yield name, obj, doc
