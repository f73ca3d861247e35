"""GPU tests reuse the engine tests' model builders (tests/engine/hf_models.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
