"""FFN sections of ``benchmarks/kernels/selective_fp8.py``: the fused GELU producer and kernel launch sweeps.

* :func:`gelu_kernel_check` -- the fused GELU + FP8 kernel: quantization bitwise against its own activation,
  the activation against torch's GELU on the same device (fraction of bitwise-equal elements, largest distance
  in bfloat16 ulps), on many shapes and on every normal bfloat16 value.
* :func:`producer_bench` -- "FFN down with producer" at W81 (M x 8960 -> 1536): dense (torch GELU + bf16
  Linear) vs the fused producer (GELU-quant kernel + ``_scaled_mm``) vs the per-Linear plugin path (torch GELU
  + quant kernel + ``_scaled_mm``), plus the parts alone.
* :func:`whole_ffn_bench` -- the whole FFN (up + GELU + down) at W81: a diffusers ``FeedForward`` dense vs the
  same module with ``selective_fp8`` installed, fused and per-Linear (``fuse_gelu: false``).
* :func:`kernel_sweep` -- kernel-only times (CUDA-graph replay, no launch overhead) of the quantizer and the
  fused kernel for a few ``BLOCK_M`` x ``num_warps`` settings; every setting gives the same bytes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from worldfoundry_selective_fp8.plugin import prepare

from worldfoundry.base_models.diffusion_model.optimizations.plugins import (
    install_diffusion_accelerations,
)
from worldfoundry.bench.microbench import Region, interleaved, rel_l2, sync
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.kernels.dispatch import (
    gelu_quantize_activations_rowwise_fp8,
    quantize_activations_rowwise_fp8,
)
from worldfoundry.core.acceleration.kernels.fp8_gelu_quant import (
    bfloat16_ulp_distance,
    gelu_float64,
    reference_gelu_quantize_rowwise_fp8,
    triton_gelu_quantize_rowwise_fp8,
)
from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import (
    ACTIVATION_GELU_TANH,
    ACTIVATION_NONE,
    TRITON_AVAILABLE,
    interpreter_enabled,
    launch_config,
    triton_quantize_rowwise_fp8,
)
from worldfoundry.core.acceleration.quantization.fp8 import quantize_rowwise_fp8
from worldfoundry.core.acceleration.quantization.fp8_linear import (
    fp8_rowwise_linear,
    quantize_weight_rowwise_fp8,
    scaled_mm_rowwise,
)
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy

INNER, DIM = 8960, 1536
#: Kernel-only budget of the fused GELU-quant kernel at 32,760 x 8,960 (issue #7: fused kernel + the 0.68 ms
#: ``_scaled_mm`` within dense / 1.3 = 1.11 ms).
GELU_QUANT_TARGET_MS = 0.40


def kernels_runnable(device: torch.device) -> str | None:
    if not TRITON_AVAILABLE:
        return "triton not importable"
    if device.type != "cuda" and not interpreter_enabled():
        return "the Triton kernels need CUDA (or TRITON_INTERPRET=1 on the CPU)"
    return None


def graph_ms(fn: Callable[[], Any], iters: int = 20, reps: int = 5) -> float | None:
    """Median milliseconds per call of ``fn`` replayed from a CUDA graph (no Python or launch overhead)."""
    if not torch.cuda.is_available():
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        with Region(torch.device("cuda"), sync_before=False) as region:
            graph.replay()
        samples.append(region.device_ms / iters)
    del graph
    return statistics.median(samples)


def _activation_stats(h: torch.Tensor, approximate: str) -> dict[str, Any]:
    q, scale, act = triton_gelu_quantize_rowwise_fp8(h, approximate, return_activation=True)
    q_own, s_own = quantize_rowwise_fp8(act)
    q_ref, s_ref, dense = reference_gelu_quantize_rowwise_fp8(h, approximate, return_activation=True)
    ulps = bfloat16_ulp_distance(act, dense)
    exact = gelu_float64(h, approximate)
    bound = 2.0**-8 * exact.abs() + 2.0**-20 * h.double().abs()  # half a bf16 ulp + float32 evaluation error
    return {
        "max_error_over_bound_kernel": float(((act.double() - exact).abs() / bound).nan_to_num(0.0).max()),
        "max_error_over_bound_torch": float(((dense.double() - exact).abs() / bound).nan_to_num(0.0).max()),
        "quantization_bitwise": bool(torch.equal(q.view(torch.uint8), q_own.view(torch.uint8))
                                     and torch.equal(scale, s_own)),
        "activation_equal_fraction": float((ulps == 0).double().mean()),
        "activation_max_ulp": int(ulps.max()) if ulps.numel() else 0,
        "fp8_equal_fraction_vs_reference": float((q.view(torch.uint8) == q_ref.view(torch.uint8)).double().mean()),
        "scales_equal_fraction_vs_reference": float((scale == s_ref).double().mean()),
    }


def gelu_kernel_check(device: torch.device, smoke: bool) -> dict[str, Any]:
    blocked = kernels_runnable(device)
    if blocked:
        return {"skipped": blocked}
    shapes = [(7, 48), (5, 100), (3, 2, 40)] if smoke else [
        (1, 16), (17, 1536), (1023, 8960), (4097, 3072), (32760, 8960), (5, 13824), (3, 16432), (9, 3, 8960)]
    g = torch.Generator(device=device).manual_seed(1)
    cases = []
    for approximate in ("tanh", "none"):
        for shape in shapes:
            h = (torch.randn(*shape, generator=g, device=device) * 2).to(torch.bfloat16)
            cases.append({"shape": list(shape), "approximate": approximate, **_activation_stats(h, approximate)})
        bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        values = bits[(bits.float().abs() >= 2.0**-100) & (bits.float().abs() <= 1e6)]
        values = torch.cat([values, -values])
        pad = (-values.numel()) % 1000
        h = torch.cat([values, torch.ones(pad, dtype=torch.bfloat16)]).reshape(-1, 1000).to(device)
        cases.append({"shape": "every normal bfloat16 value", "approximate": approximate,
                      **_activation_stats(h, approximate)})
    return {
        "cases": cases,
        "all_quantization_bitwise": all(c["quantization_bitwise"] for c in cases),
        "activation_bitwise_vs_torch_gelu": all(c["activation_equal_fraction"] == 1.0 for c in cases),
        "min_activation_equal_fraction": min(c["activation_equal_fraction"] for c in cases),
        "max_activation_ulp": max(c["activation_max_ulp"] for c in cases),
        "max_error_over_bound_kernel": max(c["max_error_over_bound_kernel"] for c in cases),
        "activation_within_bound": all(c["max_error_over_bound_kernel"] <= 1.0 for c in cases),
        "ulp_note": "bfloat16 ulps between the kernel's and torch's activation (values near zero span many ulps); "
                    "error/bound <= 1 means within 2**-8*|gelu| + 2**-20*|x| of the float64 formula",
    }


def producer_bench(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """FFN down projection with its GELU producer, W81 rows, tanh GELU."""
    m, k, n = (64, 48, 32) if args.smoke else (args.tokens, INNER, DIM)
    g = torch.Generator(device=device).manual_seed(11)
    h = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    lin = torch.nn.Linear(k, n).to(device, torch.bfloat16).eval()
    w, b = lin.weight.detach(), lin.bias.detach()
    w8 = quantize_weight_rowwise_fp8(w)
    act = F.gelu(h, approximate="tanh")
    q_act, s_act = quantize_rowwise_fp8(act)
    fused_backend = "auto" if device.type == "cuda" else "torch"

    def fused(fast: bool = False) -> torch.Tensor:
        rows = gelu_quantize_activations_rowwise_fp8(h, "tanh", backend=fused_backend)
        return scaled_mm_rowwise(rows.q, rows.scale, w8, b, use_fast_accum=fast)

    candidates: dict[str, Callable[[], Any]] = {
        "dense: torch GELU + bf16 Linear": lambda: F.linear(F.gelu(h, approximate="tanh"), w, b),
        "plugin fused: GELU-quant kernel + _scaled_mm": fused,
        "plugin per-Linear: torch GELU + quant kernel + _scaled_mm":
            lambda: fp8_rowwise_linear(F.gelu(h, approximate="tanh"), w8, b),
        "plugin fused, use_fast_accum=True": lambda: fused(True),
        "bf16 Linear alone (strict per-Linear dense)": lambda: F.linear(act, w, b),
        "torch GELU alone": lambda: F.gelu(h, approximate="tanh"),
        "fused GELU-quant kernel alone": lambda: gelu_quantize_activations_rowwise_fp8(h, "tanh",
                                                                                      backend=fused_backend),
        "quant kernel alone (on the GELU output)": lambda: quantize_activations_rowwise_fp8(act),
        "_scaled_mm alone": lambda: scaled_mm_rowwise(q_act, s_act, w8, b),
    }
    entry: dict[str, Any] = {"M": m, "K": k, "N": n, "approximate": "tanh"}
    with torch.inference_mode():
        entry["timing"] = interleaved(candidates, device, rounds=args.rounds, warmup=args.warmup,
                                      iters=args.linear_iters, baseline="dense: torch GELU + bf16 Linear")
        dense = candidates["dense: torch GELU + bf16 Linear"]().float()
        out_fused = fused().float()
        out_per_linear = candidates["plugin per-Linear: torch GELU + quant kernel + _scaled_mm"]().float()
        entry["rel_l2_fused_vs_dense"] = rel_l2(out_fused, dense)
        entry["fused_equals_per_linear_fraction"] = float((out_fused == out_per_linear).double().mean())
        if device.type == "cuda":
            kernel = graph_ms(lambda: triton_gelu_quantize_rowwise_fp8(h, "tanh"))
            gelu = graph_ms(lambda: F.gelu(h, approximate="tanh"))
            entry["kernel_only_ms"] = {"fused GELU-quant (graph)": kernel, "torch GELU (graph)": gelu}
            entry["fused_kernel_gb_per_s"] = m * k * 3 / (kernel * 1e-3) / 1e9 if kernel else None
    entry["bytes_note"] = ("fused kernel: reads h (2 bytes/element) and writes FP8 (1 byte/element); the unfused "
                           "path adds the GELU output write and its re-read (4 bytes/element)")
    return entry


def _ffn_module(device: torch.device, dim: int, inner: int) -> torch.nn.Module:
    from diffusers.models.attention import FeedForward

    torch.manual_seed(3)
    return FeedForward(dim, inner_dim=inner, activation_fn="gelu-approximate").to(device, torch.bfloat16).eval()


def whole_ffn_bench(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """Up + GELU + down of one Wan FFN at W81: dense module vs the module with the plugin installed."""
    m, dim, inner = (64, 32, 48) if args.smoke else (args.tokens, DIM, INNER)
    dense = _ffn_module(device, dim, inner)
    variants: dict[str, torch.nn.Module] = {"dense FeedForward": dense}
    sessions = {}
    reg = AccelerationRegistry(discover=False)
    reg.register("selective_fp8", prepare)
    for name, fuse in (("plugin fused", True), ("plugin per-Linear (fuse_gelu=false)", False),
                       ("plugin fused, use_fast_accum=True", "fast")):
        module = copy.deepcopy(dense)
        spec = {"include": ["net.0.proj", "net.2"], "min_tokens": 1, "fuse_gelu": bool(fuse),
                "use_fast_accum": fuse == "fast"}
        sessions[name] = install_diffusion_accelerations(module, {"selective_fp8": spec},
                                                         RuntimePolicy(device=device, dtype="bf16"), registry=reg)
        variants[name] = module
    g = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(1, m, dim, generator=g, device=device).to(torch.bfloat16)
    entry: dict[str, Any] = {"M": m, "dim": dim, "inner": inner, "activation": "gelu-approximate (tanh)"}
    with torch.inference_mode():
        reference = dense(x).float()
        proof = {}
        for name, session in sessions.items():
            with request_scope(RequestContext(f"ffn-{name}")):
                out = variants[name](x).float()
            record = session.execution_report()["plugins"]["selective_fp8"]["model"]["requests"][f"ffn-{name}"]
            proof[name] = {"modules": record["modules"], "fallbacks": record["fallbacks"],
                           "skipped": record["skipped"], "rel_l2_vs_dense": rel_l2(out, reference)}
        entry["execution"] = proof
        calls = {name: (lambda mod=mod: mod(x)) for name, mod in variants.items()}
        entry["timing"] = interleaved(calls, device, rounds=args.rounds, warmup=args.warmup,
                                      iters=args.linear_iters, baseline="dense FeedForward")
    for session in sessions.values():
        session.uninstall()
    return entry


def kernel_sweep(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    """Kernel-only times of a few launch settings (CUDA graphs); the default setting is marked."""
    if device.type != "cuda" or args.smoke:
        return {"skipped": "needs CUDA (kernel-only timing uses CUDA graphs)"}
    m = args.tokens
    g = torch.Generator(device=device).manual_seed(2)
    cases = {
        "quant K=1536": (1536, False, [(1, 4), (2, 4), (4, 4), (4, 8), (8, 4), (8, 8)]),
        "quant K=8960": (8960, False, [(1, 2), (1, 4), (1, 8), (2, 8)]),
        # rows per program x warps around the default (1 row, 8 warps: ~35 elements per thread)
        "GELU-quant K=8960": (8960, True, [(1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 16)]),
        "GELU-quant K=1536": (1536, True, [(2, 4), (4, 4), (4, 8), (8, 8)]),
    }
    out: dict[str, Any] = {"gelu_quant_target_ms": GELU_QUANT_TARGET_MS}
    for label, (k, gelu, settings) in cases.items():
        x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16) * 2
        default = launch_config(k, ACTIVATION_GELU_TANH if gelu else ACTIVATION_NONE)
        rows = []
        for block_m, warps in settings:
            cfg = {"BLOCK_M": block_m, "num_warps": warps}
            if gelu:
                fn = (lambda cfg=cfg, x=x: triton_gelu_quantize_rowwise_fp8(x, "tanh", config=cfg))
            else:
                fn = (lambda cfg=cfg, x=x: triton_quantize_rowwise_fp8(x, config=cfg))
            try:
                ms = graph_ms(fn)
                row = {"BLOCK_M": block_m, "num_warps": warps, "ms": ms,
                       "gb_per_s": m * k * 3 / (ms * 1e-3) / 1e9,
                       "default": block_m == default["BLOCK_M"] and warps == default["num_warps"]}
                if gelu and k == INNER:
                    row["meets_target"] = ms <= GELU_QUANT_TARGET_MS * m / 32760
                rows.append(row)
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile is reported, not fatal
                rows.append({"BLOCK_M": block_m, "num_warps": warps, "error": f"{type(exc).__name__}: {exc}"})
        out[label] = {"default": {"BLOCK_M": default["BLOCK_M"], "num_warps": default["num_warps"],
                                  "pieces": list(default["PIECES"])}, "settings": rows}
        del x
    sync(device)
    return out


__all__ = ["gelu_kernel_check", "graph_ms", "kernel_sweep", "producer_bench", "whole_ffn_bench"]
