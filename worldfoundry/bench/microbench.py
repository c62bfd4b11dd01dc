"""Shared pieces of the GPU micro-benchmarks under ``benchmarks/``: standard workloads, synchronised timing and
interleaved rounds with paired ratios.

The timing primitives (:func:`time_ms`, :class:`Region`, :func:`time_calls`, :func:`timing_events`, :func:`sync`)
live in :mod:`worldfoundry.core.timing` and are re-exported here for the benchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any, Final

import torch

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


def interleaved(calls: dict[str, Callable[[], Any]], device: torch.device, *, rounds: int, warmup: int, iters: int,
                baseline: str) -> dict[str, dict[str, Any]]:
    """Warm-up, then ``rounds`` rounds running every call once per round in a rotating order.

    Returns per call: median milliseconds, the samples, ``speedup_vs_<baseline>`` (ratio of medians) and the
    median/min/max of the per-round paired ratios ``baseline / call`` (> 1 means faster than the baseline).
    """
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    sync(device)
    names = list(calls)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            samples[name].append(time_ms(calls[name], device, iters))
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        ratios = [b / c for b, c in zip(samples[baseline], samples[name], strict=True)]
        out[name] = {"median_ms": statistics.median(samples[name]), "rounds_ms": samples[name],
                     "speedup_vs_" + baseline: statistics.median(samples[baseline]) / statistics.median(samples[name]),
                     "paired_speedup_median": statistics.median(ratios),
                     "paired_speedup_min": min(ratios), "paired_speedup_max": max(ratios)}
    return out


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
    "bf16_wan",
    "count_host_syncs",
    "interleaved",
    "provenance",
    "rel_l2",
    "sync",
    "time_calls",
    "time_ms",
    "timing_events",
]
