"""Load time and peak RSS of SafetensorsTensorStore against safetensors' own loaders.

Writes a safetensors file of bf16 tensors with transformer-like shapes (Wan-2.1-1.3B-sized blocks:
dim 1536, FFN 8960, self/cross attention, norms, biases, modulation) into a temporary directory, then
measures every loader in its own subprocess so that ``ru_maxrss`` is per loader. Rounds are interleaved
(a, b, c, ..., a, b, c, ...); medians are reported.

Each child imports everything first, records its RSS, then times:

* ``load_s``  - the loader call itself;
* ``touch_s`` - reading one byte of every 4 KiB page of every returned tensor (a memory-mapped result is
  only read from the file when touched, so ``load_s`` alone would flatter it);
* ``total_s`` - both, i.e. the time until every byte is in the process.

``peak_rss_mib`` is ``ru_maxrss`` after the touch pass minus the RSS before loading. ``rss_file_mib`` is
the part of the final RSS that is file-backed (mapped file pages shared with the page cache). ``cpu_s``
(user + system time of all threads) and ``minor_faults`` are taken from ``getrusage`` around the same
span; CPU time is much less sensitive than wall time to other processes competing for the cores.

Page cache: ``--cache warm`` (default) reads the whole file once, untimed, before the rounds, so every
loader reads from the page cache. ``--cache cold`` drops the file's pages with
``posix_fadvise(DONTNEED)`` before every child instead.

Usage::

    python benchmarks/loading/tensor_store.py --size-gb 1.0 --rounds 3 --out bench_out/tensor_store
    python benchmarks/loading/tensor_store.py --smoke --out /tmp/ts_smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

LOADERS: dict[str, str] = {
    "store": "SafetensorsTensorStore(path).read_all()",
    "store_1thread": "SafetensorsTensorStore(path, read_workers=1).read_all()",
    "load_file": "safetensors.torch.load_file(path)  (mmap backend, default)",
    "safe_open": "safe_open(path, 'pt') + get_tensor(k) per key",
    "load_file_pread": "safetensors.torch.load_file(path, backend='pread')",
}
REFERENCE = "load_file"
PAGE = 4096


# --- child ------------------------------------------------------------------------------------------------


def _status_mib() -> dict[str, float]:
    out: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


def _loader(name: str) -> Callable[[str], dict[str, Any]]:
    import safetensors.torch
    from safetensors import safe_open

    from worldfoundry.core.model_loading.tensor_store import SafetensorsTensorStore

    def via_safe_open(path: str) -> dict[str, Any]:
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    table: dict[str, Callable[[str], dict[str, Any]]] = {
        "store": lambda p: SafetensorsTensorStore(p).read_all(),
        "store_1thread": lambda p: SafetensorsTensorStore(p, read_workers=1).read_all(),
        "load_file": lambda p: safetensors.torch.load_file(p),
        "safe_open": via_safe_open,
        "load_file_pread": lambda p: safetensors.torch.load_file(p, backend="pread"),
    }
    return table[name]


def run_child(loader: str, path: str) -> dict[str, Any]:
    """Measure one loader in this (fresh) process and return the measurement."""
    import gc

    import torch

    load = _loader(loader)
    gc.collect()
    before = _status_mib()
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    maxrss_before = usage_before.ru_maxrss / 1024
    t0 = time.perf_counter()
    tensors = load(path)
    t1 = time.perf_counter()
    checksum = 0
    for t in tensors.values():
        if t.numel():
            checksum += int(t.reshape(-1).view(torch.uint8)[::PAGE].sum())
    t2 = time.perf_counter()
    usage_after = resource.getrusage(resource.RUSAGE_SELF)
    maxrss_after = usage_after.ru_maxrss / 1024
    after = _status_mib()
    return {
        "loader": loader,
        "load_s": t1 - t0,
        "touch_s": t2 - t1,
        "total_s": t2 - t0,
        "cpu_s": (usage_after.ru_utime + usage_after.ru_stime) - (usage_before.ru_utime + usage_before.ru_stime),
        "minor_faults": usage_after.ru_minflt - usage_before.ru_minflt,
        "major_faults": usage_after.ru_majflt - usage_before.ru_majflt,
        "peak_rss_mib": maxrss_after - before["VmRSS"],
        "baseline_rss_mib": before["VmRSS"],
        "baseline_maxrss_mib": maxrss_before,
        "rss_anon_mib": after["RssAnon"] - before["RssAnon"],
        "rss_file_mib": after["RssFile"] - before["RssFile"],
        "tensors": len(tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "sample_checksum": checksum,
    }


# --- parent -----------------------------------------------------------------------------------------------


def transformer_like_shapes(target_bytes: int, dim: int = 1536, ffn: int = 8960) -> dict[str, tuple[int, ...]]:
    """Names and shapes of Wan-like blocks (bf16) until ``target_bytes`` is reached."""
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding.weight": (dim, 16, 1, 2, 2),
        "patch_embedding.bias": (dim,),
        "condition_embedder.text_embedder.linear_1.weight": (dim, 4096),
        "condition_embedder.time_proj.weight": (6 * dim, dim),
    }
    total = sum(_numel(s) * 2 for s in shapes.values())
    block = 0
    while total < target_bytes:
        prefix = f"blocks.{block}."
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                shapes[f"{prefix}{attn}.{proj}.weight"] = (dim, dim)
                shapes[f"{prefix}{attn}.{proj}.bias"] = (dim,)
            shapes[f"{prefix}{attn}.norm_q.weight"] = (dim,)
            shapes[f"{prefix}{attn}.norm_k.weight"] = (dim,)
        shapes[f"{prefix}ffn.net.0.proj.weight"] = (ffn, dim)
        shapes[f"{prefix}ffn.net.0.proj.bias"] = (ffn,)
        shapes[f"{prefix}ffn.net.2.weight"] = (dim, ffn)
        shapes[f"{prefix}ffn.net.2.bias"] = (dim,)
        shapes[f"{prefix}norm2.weight"] = (dim,)
        shapes[f"{prefix}scale_shift_table"] = (1, 6, dim)
        total = sum(_numel(s) * 2 for s in shapes.values())
        block += 1
    shapes["proj_out.weight"] = (64, dim)
    shapes["scale_shift_table"] = (1, 2, dim)
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_checkpoint(path: Path, size_gb: float) -> dict[str, Any]:
    """Write the benchmark checkpoint (runs in a child so the parent's peak RSS stays small)."""
    import safetensors
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    dims = {"dim": 1536, "ffn": 8960} if size_gb >= 0.2 else {"dim": 384, "ffn": 1536}
    shapes = transformer_like_shapes(int(size_gb * 1e9), **dims)
    tensors = {k: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(tensors, str(path), metadata={"format": "pt", "writer": "benchmarks/loading/tensor_store.py"})
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"tensors": len(tensors), "bytes": path.stat().st_size, **dims,
            "torch": torch.__version__, "safetensors": safetensors.__version__}


def warm_page_cache(path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - t0


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def spawn(*args: str) -> dict[str, Any]:
    """Run this script in a fresh child process and return the JSON it prints last.

    The parent never imports torch and never holds tensors: Linux carries the parent's RSS high-water
    mark into a forked child's ``ru_maxrss``, so a lean parent keeps the children's baselines honest.
    """
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def provenance(versions: dict[str, Any]) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False).stdout.strip()
        except OSError:
            return ""

    return {
        "git_revision": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain")),
        "python": platform.python_version(),
        "torch": versions.get("torch"),
        "safetensors": versions.get("safetensors"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "loadavg_1_5_15_at_end": list(os.getloadavg()),
    }


def summarize(rows: list[dict[str, Any]], loaders: list[str]) -> dict[str, dict[str, float]]:
    summary: dict[str, dict[str, float]] = {}
    for name in loaders:
        mine = [r for r in rows if r["loader"] == name]
        summary[name] = {
            key: statistics.median(r[key] for r in mine)
            for key in ("load_s", "touch_s", "total_s", "cpu_s", "minor_faults", "peak_rss_mib", "rss_anon_mib",
                        "rss_file_mib")
        }
    ref = summary.get(REFERENCE)
    for name, s in summary.items():
        if ref:
            s["total_vs_load_file"] = s["total_s"] / ref["total_s"] if ref["total_s"] else float("nan")
            s["peak_rss_vs_load_file"] = s["peak_rss_mib"] / ref["peak_rss_mib"] if ref["peak_rss_mib"] else float("nan")
    return summary


def table(summary: dict[str, dict[str, float]], gib: float) -> str:
    head = (f"{'loader':<16} {'load s':>8} {'touch s':>8} {'total s':>8} {'GiB/s':>6} {'cpu s':>6} "
            f"{'faults':>7} {'peak RSS MiB':>13} "
            f"{'anon MiB':>9} {'file MiB':>9} {'total/lf':>9} {'peak/lf':>8}")
    lines = [head, "-" * len(head)]
    for name, s in summary.items():
        lines.append(
            f"{name:<16} {s['load_s']:>8.3f} {s['touch_s']:>8.3f} {s['total_s']:>8.3f} "
            f"{gib / s['total_s']:>6.2f} {s['cpu_s']:>6.2f} {s['minor_faults']:>7.0f} {s['peak_rss_mib']:>13.0f} {s['rss_anon_mib']:>9.0f} "
            f"{s['rss_file_mib']:>9.0f} {s.get('total_vs_load_file', float('nan')):>9.2f} "
            f"{s.get('peak_rss_vs_load_file', float('nan')):>8.2f}"
        )
    return "\n".join(lines)


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="checkpoint size in GB (1e9 bytes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench_out/tensor_store"))
    parser.add_argument("--cache", choices=("warm", "cold"), default="warm")
    parser.add_argument("--loaders", default=",".join(LOADERS), help=f"comma list of {', '.join(LOADERS)}")
    parser.add_argument("--tmpdir", default=None, help="where to write the temporary checkpoint")
    parser.add_argument("--smoke", action="store_true", help="tiny file, one round (CI check)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--write", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(run_child(args.child, args.file)))
        return 0
    if args.write:
        print(json.dumps(write_checkpoint(Path(args.write), args.size_gb)))
        return 0
    if args.smoke:
        args.size_gb, args.rounds = min(args.size_gb, 0.05), 1
    loaders = [n.strip() for n in args.loaders.split(",") if n.strip()]
    unknown = [n for n in loaders if n not in LOADERS]
    if unknown:
        parser.error(f"unknown loader(s) {unknown}; choose from {list(LOADERS)}")
    args.out.mkdir(parents=True, exist_ok=True)

    rows: list[dict[str, Any]] = []
    loadavg_start = list(os.getloadavg())
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        path = Path(tmp) / "checkpoint.safetensors"
        t0 = time.perf_counter()
        written = spawn("--write", str(path), "--size-gb", str(args.size_gb))
        print(f"wrote {written['bytes'] / 2**30:.3f} GiB, {written['tensors']} bf16 tensors "
              f"in {time.perf_counter() - t0:.1f}s to {path}", flush=True)
        warm_s = warm_page_cache(path) if args.cache == "warm" else None
        for rnd in range(args.rounds):
            for name in loaders:
                if args.cache == "cold":
                    drop_page_cache(path)
                row = spawn("--child", name, "--file", str(path))
                row["round"] = rnd
                rows.append(row)
                print(f"round {rnd} {name:<16} total {row['total_s']:.3f}s peak {row['peak_rss_mib']:.0f} MiB",
                      flush=True)

    checksums = {r["sample_checksum"] for r in rows}
    byte_counts = {r["bytes"] for r in rows}
    summary = summarize(rows, loaders)
    gib = written["bytes"] / 2**30
    cache_note = (
        f"warm: the file was read once, untimed ({warm_s:.2f}s), before the rounds; all loaders read from the page cache"
        if args.cache == "warm"
        else "cold: posix_fadvise(DONTNEED) dropped the file's pages before every child"
    )
    result = {
        "benchmark": "tensor_store",
        "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "file": {"tensors": written["tensors"], "bytes": written["bytes"], "gib": gib, "dtype": "bf16",
                 "dim": written["dim"], "ffn": written["ffn"]},
        "rounds": args.rounds,
        "order": "interleaved: " + ", ".join(loaders) + " per round",
        "page_cache": cache_note,
        "loaders": {n: LOADERS[n] for n in loaders},
        "all_loaders_same_bytes": len(checksums) == 1 and len(byte_counts) == 1,
        "summary_median": summary,
        "rows": rows,
        "provenance": {**provenance(written), "loadavg_1_5_15_at_start": loadavg_start,
                       "parent_maxrss_mib": _maxrss_mib()},
    }
    out_file = args.out / "tensor_store.json"
    out_file.write_text(json.dumps(result, indent=2))
    print()
    print(f"file: {gib:.3f} GiB, {written['tensors']} bf16 tensors; {args.rounds} interleaved round(s); "
          f"page cache: {cache_note}")
    print(f"load average (1/5/15 min) at start {loadavg_start}, at end {list(os.getloadavg())}; "
          f"{os.cpu_count()} CPUs")
    print(f"all loaders returned the same bytes (sampled checksum): {result['all_loaders_same_bytes']}")
    print(f"medians; 'lf' = {REFERENCE}; JSON: {out_file}")
    print(table(summary, gib))
    return 0 if result["all_loaders_same_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
