"""``benchmarks/kernels/fp8_host_profile.py --smoke`` runs on the CPU and writes every piece it names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from worldfoundry.core.model_loading.recipes import project_root

SCRIPT = project_root() / "benchmarks" / "kernels" / "fp8_host_profile.py"
PIECES = {"dense_ffn", "fp8_ffn", "fp8_ffn_normal_launch", "fused_run", "gate", "receipts", "kernels_chain",
          "quantize", "gelu_quantize", "scaled_mm", "bf16_linear", "bf16_down"}


@pytest.mark.skipif(not SCRIPT.exists(), reason="benchmarks/ is not part of an installed package")
def test_the_smoke_run_times_every_piece_and_records_the_fused_calls(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--reps", "3", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, check=False)
    if "no rowwise torch._scaled_mm" in done.stdout + done.stderr:
        pytest.skip("this CPU build of torch has no rowwise torch._scaled_mm")
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "fp8_host_profile.json").read_text())
    assert set(data["pieces"]) == PIECES
    for row in data["pieces"].values():
        assert row["host_us"] > 0 and row["queued_us"] > 0 and row["device_us"] is None
    counters = data["receipts"]["counters"]
    # every fused call records both Linears' FP8 GEMMs and the fused producer (the kernel chain records nothing)
    assert counters["fp8_gelu_fused"] > 0 and counters["fp8_gemm"] == 2 * counters["fp8_gelu_fused"]
    assert data["launch_path"] in ("direct", "normal", "interpreter")
    assert "function calls" in (tmp_path / "fp8_host_profile.txt").read_text()
