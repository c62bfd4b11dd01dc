"""Shared pieces of the GPU micro-benchmarks under ``benchmarks/``: standard workloads, synchronised timing and
interleaved rounds with paired ratios.

The timing primitives (:func:`time_ms`, :class:`Region`, :func:`time_calls`, :func:`timing_events`, :func:`sync`)
live in :mod:`worldfoundry.core.timing` and are re-exported here for the benchmarks."""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

from worldfoundry.bench.host_speed import probe_ms
from worldfoundry.core.timing import Region, count_host_syncs, sync, time_calls, time_ms, timing_events

#: Wan2.1-T2V-1.3B transformer config (the W17/W81 architecture) and a tiny variant for CPU smoke runs.
WAN_1_3B: Final[dict[str, Any]] = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN_TINY: Final[dict[str, Any]] = dict(WAN_1_3B, num_attention_heads=2, attention_head_dim=32, text_dim=32,
                                       freq_dim=32, ffn_dim=128, num_layers=2, rope_max_seq_len=64)
#: latent frames x height x width of the standard workloads, and CPU smoke stand-ins.
WORKLOADS: Final[dict[str, tuple[int, int, int]]] = {"W17": (5, 40, 72), "W81": (21, 60, 104)}
SMOKE_WORKLOADS: Final[dict[str, tuple[int, int, int]]] = {"W17": (2, 8, 8), "W81": (3, 8, 12)}
RANDOM_NOTE: Final = "random seeded weights: relative L2 describes these weights only, not visual quality"


@dataclass
class RoundSamples:
    """Per call, one sample a round: device milliseconds and host enqueue milliseconds per call, and the host
    probe (:func:`~worldfoundry.bench.host_speed.probe_ms`) taken right before the sample."""

    device_ms: dict[str, list[float]]
    enqueue_ms: dict[str, list[float]]
    #: collections of Python's garbage collector during the timed rounds (``None``: it was not frozen)
    gc_collections: int | None = None
    host_probe_ms: dict[str, list[float]] | None = None


def _gc_collections() -> int:
    return sum(s["collections"] for s in gc.get_stats())


def interleaved_samples(calls: dict[str, Callable[[], Any]], device: torch.device, *, rounds: int, warmup: int,
                        iters: int, freeze_gc: bool = False) -> RoundSamples:
    """Warm-up, then ``rounds`` rounds running every call once per round in a rotating order.

    Args:
        calls: name -> the work of one call.
        rounds / warmup: timed rounds and untimed warm-up rounds; ``iters``: back-to-back calls per sample.
        freeze_gc: collect, then freeze Python's garbage collector during the timed rounds (counted).

    Returns:
        The :class:`RoundSamples` (milliseconds per call).
    """
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    sync(device)
    names = list(calls)
    samples = RoundSamples({n: [] for n in names}, {n: [] for n in names}, host_probe_ms={n: [] for n in names})
    if freeze_gc:
        gc.collect()
        gc.freeze()
        collections = _gc_collections()
    try:
        for r in range(rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                samples.host_probe_ms[name].append(probe_ms())  # the host's speed at this sample
                region = time_calls(calls[name], device, iters)
                samples.device_ms[name].append(region.device_ms / iters)
                samples.enqueue_ms[name].append(region.enqueue_ms / iters)
    finally:
        if freeze_gc:
            samples.gc_collections = _gc_collections() - collections
            gc.unfreeze()
    return samples


def paired_summary(samples: dict[str, list[float]], baseline: str) -> dict[str, dict[str, Any]]:
    """Per call: median milliseconds, the samples, ``speedup_vs_<baseline>`` (ratio of medians) and the
    median/min/max of the per-round paired ratios ``baseline / call`` (> 1 means faster than the baseline)."""
    out: dict[str, dict[str, Any]] = {}
    for name, values in samples.items():
        ratios = [b / c for b, c in zip(samples[baseline], values, strict=True)]
        out[name] = {"median_ms": statistics.median(values), "rounds_ms": values,
                     "speedup_vs_" + baseline: statistics.median(samples[baseline]) / statistics.median(values),
                     "paired_speedup_median": statistics.median(ratios),
                     "paired_speedup_min": min(ratios), "paired_speedup_max": max(ratios)}
    return out


def interleaved(calls: dict[str, Callable[[], Any]], device: torch.device, *, rounds: int, warmup: int, iters: int,
                baseline: str) -> dict[str, dict[str, Any]]:
    """:func:`interleaved_samples` summarised by :func:`paired_summary` (device time).

    Returns per call: median milliseconds, the samples, ``speedup_vs_<baseline>`` (ratio of medians), the
    median/min/max of the per-round paired ratios ``baseline / call`` (> 1 means faster than the baseline), and
    the host probes taken before its samples (``host_probe_ms``, ``host_probe_median_ms``): a host-bound call timed
    while the machine ran slow shows it there.
    """
    samples = interleaved_samples(calls, device, rounds=rounds, warmup=warmup, iters=iters)
    out = paired_summary(samples.device_ms, baseline)
    for name, probes in (samples.host_probe_ms or {}).items():
        out[name]["host_probe_ms"] = probes
        out[name]["host_probe_median_ms"] = statistics.median(probes) if probes else None
    return out


def adjacent_pairs(baseline: Callable[[], Any], candidate: Callable[[], Any], device: torch.device, *,
                   pairs: int, warmup: int = 2) -> dict[str, Any]:
    """Single calls of ``baseline`` and ``candidate`` back to back, ``pairs`` times, in ABBA order.

    Each pair's ratio compares two calls made within one or two call durations of each other, so a host whose
    speed changes in phases lasting longer than that (the machines measured here: seconds) slows both calls of a
    pair alike; alternating the order cancels a drift within the pair. Returns the median and the bootstrap 95 %
    CI of the per-pair ratios ``baseline / candidate`` (> 1: the candidate is faster), each arm's median
    milliseconds, the samples and the host probe (:func:`~worldfoundry.bench.host_speed.probe_ms`) before each pair.

    Example:
        >>> out = adjacent_pairs(lambda: torch.ones(64).sum(), lambda: torch.ones(8).sum(), torch.device("cpu"),
        ...                      pairs=4)
        >>> sorted(out)[:3], len(out["ratios"])
        (['baseline_median_ms', 'baseline_ms', 'candidate_median_ms'], 4)
    """
    from worldfoundry.bench.stats import bootstrap_ci

    for _ in range(warmup):
        baseline()
        candidate()
    sync(device)
    base, cand, probes = [], [], []
    for i in range(pairs):
        probes.append(probe_ms())
        order = ((base, baseline), (cand, candidate)) if i % 4 in (0, 3) else ((cand, candidate), (base, baseline))
        for sink, fn in order:
            sink.append(time_calls(fn, device, 1).device_ms)
    ratios = [b / c for b, c in zip(base, cand, strict=True)]
    low, high = bootstrap_ci(ratios)
    return {"ratio_median": statistics.median(ratios), "ratio_ci95": [low, high], "ratios": ratios,
            "baseline_median_ms": statistics.median(base), "candidate_median_ms": statistics.median(cand),
            "baseline_ms": base, "candidate_ms": cand, "host_probe_ms": probes, "order": "ABBA"}


def bf16_wan(config: dict[str, Any], device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A seeded ``WanTransformer3DModel`` built on ``device`` in bfloat16, except the tensors diffusers keeps in
    float32 when loading with ``torch_dtype=bfloat16`` (``_keep_in_fp32_modules``); eval mode."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device (fast for 1.3B parameters)
        model = WanTransformer3DModel(**config)
    keep = list(getattr(type(model), "_keep_in_fp32_modules", None) or [])
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point():
                fp32 = any(k in name.split(".") for k in keep)
                tensor.data = tensor.data.to(torch.float32 if fp32 else torch.bfloat16)
    return model.eval()


def rel_l2(test: torch.Tensor, ref: torch.Tensor) -> float:
    """``||test - ref|| / ||ref||`` in float64."""
    t, r = test.double(), ref.double()
    return float((t - r).norm() / r.norm())


def provenance(device: torch.device, *, extra_packages: tuple[str, ...] = (), **fields: Any) -> dict[str, Any]:
    """What a micro-benchmark's JSON records about where it ran: versions, device/GPU, git revision and dirty
    flag (``None`` outside a git checkout), the given ``extra_packages`` versions and any extra ``fields``."""
    import importlib.metadata

    from worldfoundry.bench.provenance import environment, git_state
    from worldfoundry.core.model_loading.recipes import project_root

    env = environment(device)
    env.setdefault("gpu", None)
    for name in extra_packages:
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    git = git_state(project_root())
    return {"git_revision": git["revision"], "git_dirty": git["dirty"], **env, **fields}


__all__ = [
    "RANDOM_NOTE",
    "SMOKE_WORKLOADS",
    "WAN_1_3B",
    "WAN_TINY",
    "WORKLOADS",
    "Region",
    "RoundSamples",
    "bf16_wan",
    "count_host_syncs",
    "interleaved",
    "interleaved_samples",
    "paired_summary",
    "provenance",
    "rel_l2",
    "sync",
    "time_calls",
    "time_ms",
    "timing_events",
]
