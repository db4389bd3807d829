"""Names of a package imported on first use: a package's ``__getattr__`` (PEP 562) built by :func:`lazy_names`,
so that importing the package does not pay for the modules behind them (torch's, or a tool's)."""

from __future__ import annotations

import importlib


def lazy_names(package: str, names: dict, namespace: dict):
    """A module ``__getattr__`` for ``package``: a name of ``names`` (``{name: submodule, relative}``) is
    imported from its submodule on first use and kept in ``namespace`` (the package's ``globals()``), so the
    next use is a plain attribute; any other name raises ``AttributeError``."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{names[name]}", package), name)
        namespace[name] = value
        return value

    return __getattr__
