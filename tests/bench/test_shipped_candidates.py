"""Every candidate file shipped under recipes/candidates/ loads: names valid, options valid for its plugins."""

from __future__ import annotations

import pytest

from worldfoundry.bench.candidates import load_candidates
from worldfoundry.core.acceleration.registry import diffusion_acceleration_registry
from worldfoundry.core.model_loading.recipes import project_root

SHIPPED = sorted((project_root() / "recipes" / "candidates").glob("*.json"))


def test_there_are_shipped_candidate_files() -> None:
    assert {p.name for p in SHIPPED} >= {"default.json", "wan2.1-1.3b-h200.json", "wan2.1-1.3b-h200-w81.json"}


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_a_shipped_candidate_file_loads(path) -> None:
    cfile = load_candidates(str(path), registry=diffusion_acceleration_registry())
    names = [c.name for c in cfile.candidates]
    assert names and len(names) == len(set(names))


def test_the_w17_file_has_the_exact_stacks() -> None:
    cfile = load_candidates(str(project_root() / "recipes" / "candidates" / "wan2.1-1.3b-h200.json"),
                            registry=diffusion_acceleration_registry())
    stacks = {c.name: set(c.accelerations) for c in cfile.candidates}
    assert stacks["block-fusion+cuda-graph"] == {"wan_block_fusion", "cuda_graph"}
    assert stacks["block-fusion+cuda-graph+fa3-self"] == {"wan_block_fusion", "cuda_graph", "attention_policy"}
    assert stacks["block-fusion+cuda-graph+fp8-ffn"] == {"wan_block_fusion", "cuda_graph", "selective_fp8"}
    assert len(stacks) == 10  # what the file's run budget is set for
