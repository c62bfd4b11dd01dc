"""The fusion modules and the plugins built on them import where triton is not installed (a CPU-only torch).

Their calls then fall back visibly; here only the imports are checked, in a subprocess whose ``import triton``
fails."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError, as where it is not installed
import worldfoundry.core.fusion.adaln, worldfoundry.core.fusion.layer_norm, worldfoundry.core.fusion.rope
import worldfoundry.core.fusion.glu
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE
assert not TRITON_AVAILABLE
import worldfoundry_block_fusion.wan_plugin, worldfoundry_block_fusion.sana_plugin
print("ok")
"""


def test_fusion_modules_and_block_fusion_import_without_triton() -> None:
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
