"""Peer reference rows on the CPU: diffusers eager and FirstBlockCache, timed like candidates, then undone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from worldfoundry.bench.harness import BenchConfig, run_bench
from worldfoundry.bench.peers import resolve_peers

WORKLOAD = {"prompt": "a red square", "frames": 5, "height": 32, "width": 32, "steps": 4, "guidance": 5.0,
            "seeds": [1]}


def _bench_with_peers(tmp_path: Path, peers: list[str]) -> dict:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"workload": WORKLOAD, "candidates": [
        {"name": "kv", "accelerations": {"wan_cross_kv_fusion": {"min_tokens": 0}}}]}))
    return run_bench(BenchConfig(model="tiny-wan2.1-trained", candidates=str(path), out=str(tmp_path / "o"),
                                 rounds=3, max_rounds=3, progress=False, peers=peers))


def test_resolve_skips_what_cannot_run_here() -> None:
    run, skipped = resolve_peers(None, torch.device("cpu"))
    reasons = {s["peer"]: s["reason"] for s in skipped}
    assert "eager" in run and "fbcache" in run and "compile" in reasons and "float8" in reasons
    run, _ = resolve_peers(["compile"], torch.device("cpu"))
    assert run == ["compile"]  # asked for explicitly: runs on the CPU too
    with pytest.raises(ValueError, match="unknown peer"):
        resolve_peers(["teacache"], torch.device("cpu"))


def test_eager_and_first_block_cache_rows(tmp_path: Path) -> None:
    results = _bench_with_peers(tmp_path, ["eager", "fbcache"])
    peers = {p["peer"]: p for p in results["peers"]}
    assert set(peers) == {"eager", "fbcache"}, results["peers"]
    for row in peers.values():
        assert row["verdict"] == "peer_reference", row.get("error")
        assert row["speed"]["rounds"] == 4 and row["warmup_s"] >= 0.0  # the step floor times 4 rounds at least
    assert peers["eager"]["latent_rel_l2"] == 0.0
    assert 0.0 <= peers["fbcache"]["latent_rel_l2"] < 1.0
    assert results["dense"]["stable_after_candidates"] is True
    assert "| peer:fbcache | peer_reference |" in (tmp_path / "o" / "report.md").read_text()
    assert all(row["restored"] for row in peers.values())


def test_a_peer_whose_undo_leaves_the_model_changed_is_named(tmp_path: Path, monkeypatch) -> None:
    """The restore check runs after each peer: the one that changed dense is named, not only "a peer"."""
    from worldfoundry.bench import peers as peers_module

    original = peers_module._apply

    def leaky(name, modules, steps=None):
        undo, info = original(name, modules, steps)
        if name != "fbcache":
            return undo, info

        def partial_undo() -> None:  # undoes the cache but leaves one bias changed, as a faulty peer would
            undo()
            with torch.no_grad():
                modules[0].proj_out.bias.add_(1.0)

        return partial_undo, info

    monkeypatch.setattr(peers_module, "_apply", leaky)
    results = _bench_with_peers(tmp_path, ["eager", "fbcache"])
    rows = {p["peer"]: p for p in results["peers"]}
    assert rows["eager"]["restored"] is True
    assert rows["fbcache"]["restored"] is False
    assert rows["fbcache"]["restore_error"] == "the dense output changed after fbcache was undone"
    assert results["dense"]["stable_after_candidates"] is False  # the harness's own final check still sees it
    assert "**not restored**: the dense output changed after fbcache was undone" in (
        tmp_path / "o" / "report.md").read_text()


def test_each_peer_is_an_item_of_the_run_budget(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"workload": WORKLOAD, "candidates": [
        {"name": "kv", "accelerations": {"wan_cross_kv_fusion": {"min_tokens": 0}}}]}))
    results = run_bench(BenchConfig(model="tiny-wan2.1-trained", candidates=str(path), out=str(tmp_path / "o"),
                                    rounds=3, max_rounds=3, progress=False, peers=["eager"], run_budget_s=3600.0))
    budget = results["run_budget"]
    # one candidate and one peer priced, none left in the reserve: the run is not reported over its budget
    assert budget["items_priced"] == 2 and budget["over_s"] == 0.0 and budget["cut"] == 0
    assert results["peers"][0]["verdict"] == "peer_reference"
