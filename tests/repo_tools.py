"""The repository's tools/ scripts as modules, for the tests that check them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_tool(name: str):
    """tools/NAME.py, imported under NAME (registered in sys.modules first: a dataclass of the
    tool looks its module up while it is defined)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    sys.modules[name] = tool
    spec.loader.exec_module(tool)
    return tool
