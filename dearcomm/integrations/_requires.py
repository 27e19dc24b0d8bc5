"""The import that an integration needs, with the install command when it is missing."""
from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"dearcomm: dearcomm.integrations.{extra} needs {module!r}, which did not import ({e}); "
                          f"install it with: pip install 'dearcomm[{extra}]'") from e
