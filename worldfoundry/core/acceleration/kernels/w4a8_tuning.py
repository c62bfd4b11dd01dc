"""Tile choice for the W4A8 GEMMs on CUDA: a committed table measured on the H200, else interleaved timing.

Triton's ``autotune`` did not pick the fastest configuration at the W81 FFN shapes (H200, commit ``e2793b9``:
autotuned 1.836 ms where a swept configuration took 1.685 ms at 1536 -> 8960, group 128; 1.518 vs 1.418 ms at
8960 -> 1536). Its benchmark (``triton.testing.do_bench``) times each configuration in a separate batch with the L2
cache flushed before every call, which can rank close candidates differently from back-to-back use (and from the
benchmark that judged them). The choice here is, in order:

1. the in-process cache (one choice per device, kernel, shape key and ``M`` bucket -- the next power of two);
2. :data:`MEASURED_CONFIGS`: tiles measured fastest by ``benchmarks/kernels/svdquant.py`` on the H200 (sm_90) for
   the W81 FFN shapes, used for ``M >= 8,192`` (the sweep ran at M = 32,760);
3. otherwise every candidate is compiled and launched once (a configuration that fails to compile is dropped),
   then timed in :data:`ROUNDS` interleaved rounds (rotating order, each sample :data:`ITERS` back-to-back
   launches between CUDA events, after :data:`WARMUP` untimed launches each) and the lowest median wins --
   the same method as the benchmark that judges the result. While a CUDA graph is being captured nothing is
   timed: the table's or the first candidate's tile is used (and not cached).

The launches write the caller's output buffer; every candidate computes the same integers, so what is left there
is a valid result.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

logger = logging.getLogger(__name__)

ROUNDS: Final = 5
ITERS: Final = 5
WARMUP: Final = 2
#: Smallest ``M`` the measured table is used for.
TABLE_MIN_M: Final = 8192


def _tile(bm: int, bn: int, swap: bool, warps: int, stages: int, **extra: Any) -> dict[str, Any]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8, "SWAP_AB": swap, "num_warps": warps, "num_stages": stages,
            **extra}


#: ``(capability, kernel, group_size, N, K)`` -> tile. Kernel ``"w4a8"``: the group-scale GEMM, measured on the
#: H200 at commit ``e2793b9`` (``benchmarks/results/h200-2026-12-01b/svdquant.json``, fastest swept
#: configuration per shape). The per-channel kernel (``"w4a8_channel"``) has no measured entry yet: it is chosen
#: by interleaved timing (step 3) until the benchmark's recorded choice is committed here.
MEASURED_CONFIGS: Final[dict[tuple[tuple[int, int], str, int, int, int], dict[str, Any]]] = {
    ((9, 0), "w4a8", 64, 8960, 1536): _tile(128, 64, True, 4, 4),
    ((9, 0), "w4a8", 128, 8960, 1536): _tile(64, 64, True, 4, 4),
    ((9, 0), "w4a8", 64, 1536, 8960): _tile(128, 64, True, 4, 4),
    ((9, 0), "w4a8", 128, 1536, 8960): _tile(64, 64, True, 4, 4),
}

_CHOSEN: dict[tuple[Any, ...], dict[str, Any]] = {}


def _bucket(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def measured_config(device: torch.device, kernel: str, group: int, n: int, k: int, m: int) -> dict[str, Any] | None:
    """The committed tile for this shape on this GPU, or ``None``."""
    if device.type != "cuda" or m < TABLE_MIN_M:
        return None
    cap = torch.cuda.get_device_capability(device)
    found = MEASURED_CONFIGS.get((tuple(cap), kernel, group, n, k))
    return None if found is None else dict(found)


def _median_ms(launch: Callable[[dict[str, Any]], Any], cfgs: list[dict[str, Any]]) -> list[float]:
    samples: list[list[float]] = [[] for _ in cfgs]
    order = list(range(len(cfgs)))
    for _ in range(WARMUP):
        for i in order:
            launch(cfgs[i])
    for r in range(ROUNDS):
        for i in order[r % len(order):] + order[: r % len(order)]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(ITERS):
                launch(cfgs[i])
            end.record()
            end.synchronize()
            samples[i].append(start.elapsed_time(end) / ITERS)
    return [statistics.median(s) for s in samples]


def choose_config(key: tuple[Any, ...], device: torch.device, m: int, candidates: Sequence[dict[str, Any]],
                  launch: Callable[[dict[str, Any]], Any], measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tile to run (see the module docstring for the order of the sources).

    Args:
        key: shape key of the kernel (kernel name, group size, N, K, flags); ``M`` is bucketed here.
        device: the CUDA device.
        m: rows of this call.
        candidates: configurations to time when nothing is cached or measured.
        launch: runs the kernel once with a configuration (writes the caller's output).
        measured: the committed table's entry for this shape, if any.

    Returns:
        The chosen configuration (a copy).

    Raises:
        RuntimeError: no candidate compiles (the last error chained).
    """
    full = (str(device), *key, _bucket(m))
    if full in _CHOSEN:
        return dict(_CHOSEN[full])
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return dict(measured or candidates[0])
    if measured is not None:
        _CHOSEN[full] = dict(measured)
        return dict(measured)
    working, last_error = [], None
    for cfg in candidates:
        try:
            launch(cfg)
            working.append(dict(cfg))
        except Exception as exc:  # a tile that does not compile on this GPU (resources) is left out
            last_error = exc
            logger.debug("w4a8 tile %s left out: %s", cfg, exc)
    if not working:
        raise RuntimeError(f"no W4A8 tile compiles for {key}") from last_error
    times = _median_ms(launch, working)
    best = working[min(range(len(working)), key=times.__getitem__)]
    logger.info("w4a8 tile for %s: %s (%.3f ms; %d candidates timed)", full, best, min(times), len(working))
    _CHOSEN[full] = best
    return dict(best)


def chosen_config(device: torch.device, key: tuple[Any, ...], m: int) -> dict[str, Any] | None:
    """What this process chose for ``key`` at ``m`` rows on ``device`` (``None`` before the first call)."""
    found = _CHOSEN.get((str(device), *key, _bucket(m)))
    return None if found is None else dict(found)


def chosen_configs() -> dict[str, dict[str, Any]]:
    """What this process chose so far, by key (for benchmark records)."""
    return {repr(k): dict(v) for k, v in _CHOSEN.items()}


__all__ = ["MEASURED_CONFIGS", "TABLE_MIN_M", "choose_config", "chosen_config", "chosen_configs", "measured_config"]
