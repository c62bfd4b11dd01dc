"""No library function over 60 lines (``tools/long_functions.py``, run here so CI keeps it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_library_function_over_sixty_lines() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "long_functions.py")], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stdout
    assert done.stdout.strip().endswith("0 functions over 60 lines")
