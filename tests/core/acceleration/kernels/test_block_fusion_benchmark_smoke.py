"""``benchmarks/kernels/block_fusion.py --smoke --fp8`` runs on the CPU: every FP8 stack is built, checked and timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worldfoundry.core.model_loading.recipes import project_root

SCRIPT = project_root() / "benchmarks" / "kernels" / "block_fusion.py"
FP8_STACKS = ("fp8", "cuda_graph+fp8", "block_fusion+fp8", "block_fusion+cuda_graph+fp8")


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ is not part of an installed package")
def test_the_fp8_stacks_are_checked_against_fp8_alone_and_fall_back_visibly_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--workloads", "W17", "--fp8", "--skip-compile",
                           "--pairs", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, check=False, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    w17 = json.loads((tmp_path / "block_fusion.json").read_text())["W17"]
    assert not any(key in w17["errors"] for key in FP8_STACKS), w17["errors"]
    for key in FP8_STACKS:
        entry = w17[key]
        assert key in w17["timing"] and key in w17["pairs"]
        if key != "fp8":  # the stacks on FP8 compute what FP8 alone computes
            assert entry["bitwise_vs_fp8"] is True
        receipts = entry["selective_fp8"]
        # the CPU has no FP8 GEMM: every FFN Linear ran dense, and the receipts say why
        assert receipts["counters"]["dense_fallback"] > 0 and receipts["modules_executed"] == 0
        assert set(receipts["fallbacks"]) == {"cpu device"}
