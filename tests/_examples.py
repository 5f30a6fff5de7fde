"""Loading a script of examples/ as a module, as the tests of its functions do."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_example(name: str, module_name: str | None = None, register: bool = False
                 ) -> ModuleType:
    """examples/``name``.py executed as a fresh module called ``module_name`` (default
    ``name``); ``register`` puts it in ``sys.modules`` first (its dataclasses look their
    module up there)."""
    spec = importlib.util.spec_from_file_location(module_name or name,
                                                  ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
