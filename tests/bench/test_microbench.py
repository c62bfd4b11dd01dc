"""``worldfoundry.bench.microbench``: interleaved rounds (rotating order, warm-up, frozen GC) and paired ratios."""

from __future__ import annotations

import gc

import pytest
import torch

from worldfoundry.bench.microbench import interleaved, interleaved_samples, paired_summary

CPU = torch.device("cpu")


def test_rounds_rotate_the_order_after_the_warm_up() -> None:
    order: list[str] = []
    calls = {n: (lambda n=n: order.append(n)) for n in ("a", "b", "c")}
    samples = interleaved_samples(calls, CPU, rounds=3, warmup=1, iters=2)
    assert order[:3] == ["a", "b", "c"]  # warm-up
    assert order[3:] == ["a", "a", "b", "b", "c", "c", "b", "b", "c", "c", "a", "a", "c", "c", "a", "a", "b", "b"]
    assert {n: len(v) for n, v in samples.device_ms.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(v >= 0.0 for values in samples.enqueue_ms.values() for v in values)
    assert samples.gc_collections is None
    assert {n: len(v) for n, v in samples.host_probe_ms.items()} == {"a": 3, "b": 3, "c": 3}


def test_frozen_gc_is_counted_and_released_even_when_a_call_fails() -> None:
    samples = interleaved_samples({"a": lambda: None}, CPU, rounds=2, warmup=0, iters=1, freeze_gc=True)
    assert samples.gc_collections is not None and samples.gc_collections >= 0
    assert gc.get_freeze_count() == 0

    def boom() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        interleaved_samples({"x": boom}, CPU, rounds=1, warmup=0, iters=1, freeze_gc=True)
    assert gc.get_freeze_count() == 0


def test_paired_summary_ratios_are_baseline_over_call_per_round() -> None:
    out = paired_summary({"dense": [2.0, 4.0, 6.0], "fast": [1.0, 4.0, 2.0]}, "dense")
    assert out["dense"]["paired_speedup_median"] == 1.0
    fast = out["fast"]
    assert fast["median_ms"] == 2.0 and fast["rounds_ms"] == [1.0, 4.0, 2.0]
    assert fast["speedup_vs_dense"] == 2.0
    assert (fast["paired_speedup_median"], fast["paired_speedup_min"], fast["paired_speedup_max"]) == (2.0, 1.0, 3.0)
    summary = interleaved({"dense": lambda: None, "other": lambda: None}, CPU, rounds=3, warmup=0, iters=1,
                          baseline="dense")
    assert set(summary) == {"dense", "other"} and len(summary["other"]["rounds_ms"]) == 3
    # one host probe before each sample, summarised per call
    assert len(summary["other"]["host_probe_ms"]) == 3 and all(p > 0 for p in summary["other"]["host_probe_ms"])
    assert summary["other"]["host_probe_median_ms"] == sorted(summary["other"]["host_probe_ms"])[1]
