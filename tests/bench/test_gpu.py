"""On CUDA: the loop timer uses device events, and the compile / FirstBlockCache peers run and are undone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from worldfoundry.bench.harness import BenchConfig, run_bench

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

WORKLOAD = {"prompt": "a red square", "frames": 5, "height": 32, "width": 32, "steps": 4, "guidance": 5.0,
            "seeds": [1]}


def test_cuda_event_timing_and_peers(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"workload": WORKLOAD, "candidates": [
        {"name": "kv", "accelerations": {"wan_cross_kv_fusion": {"min_tokens": 0}}},
        {"name": "ec", "accelerations": {"easycache": {"threshold": 0.3, "warmup_steps": 1}}}]}))
    results = run_bench(BenchConfig(model="tiny-wan2.1-trained", candidates=str(path), out=str(tmp_path / "o"),
                                    device="cuda", rounds=3, max_rounds=6, time_budget_s=10.0, progress=False,
                                    peers=["eager", "compile", "fbcache"]))
    assert results["environment"]["device"] == "cuda"
    for c in results["candidates"]:
        # a tiny model's loop under a loaded test run can read faster than a cache that skipped nothing may be:
        # then the receipts bound must be what flags it, never anything else
        if c["verdict"] == "invalid_timing":
            assert c["name"] == "ec" and "receipts bound" in c["timing_invalid"], c
            assert c["speed"]["speedup"] > c["speed_bound"] * 1.05, c
        steps = c["speed"]["steps_s"]
        assert len(steps["dense"][0]) == WORKLOAD["steps"]
    peers = {p["peer"]: p for p in results["peers"]}
    assert all(p["verdict"] == "peer_reference" for p in peers.values()), results["peers"]
    assert peers["compile"]["warmup_s"] > 0 and peers["compile"]["latent_rel_l2"] < 1e-2
    assert results["dense"]["stable_after_candidates"] is True
