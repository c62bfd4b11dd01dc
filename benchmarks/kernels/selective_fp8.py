"""GPU evidence for ``selective_fp8``: the fused activation-quant kernels, the FFN Linears, and the whole forward.

One run does everything, in this order (each section is guarded: a failure is recorded in the JSON under
``errors`` and the run goes on; the JSON is rewritten after every section):

1. Kernel check: the Triton rowwise quantizer equals its torch reference bitwise (FP8 bytes and scales) on
   many shapes (odd, large, strided rows). The fused GELU + FP8 producer kernel: quantization bitwise against
   its own activation, and its activation against torch's GELU on this GPU (fraction of bitwise-equal elements,
   largest distance in bfloat16 ulps), on many shapes and on every normal bfloat16 value.
2. Per FFN Linear at W81 shapes (M = 32,760 tokens, Wan2.1-1.3B dims 1536 -> 8960 and 8960 -> 1536), strict
   per-Linear: bf16 ``F.linear`` vs the plugin path (fused quant + ``torch._scaled_mm`` + bias), ``_scaled_mm``
   alone (activations pre-quantized), eager per-row quantization + ``_scaled_mm``, and torchao's float8 rowwise
   Linear when importable; interleaved paired rounds, medians; relative L2 against bf16 and float64; the quant
   kernel alone both as called (with launch overhead) and replayed from a CUDA graph (kernel only).
3. FFN down with its producer at W81 (h = up-projection output, M x 8960 -> 1536): dense (torch GELU(tanh) +
   bf16 Linear) vs the plugin's fused producer (GELU-quant kernel + ``_scaled_mm``) vs the plugin's
   per-Linear path (torch GELU + quant kernel + ``_scaled_mm``), and the parts alone.
4. The whole FFN (up + GELU + down) at W81: a diffusers ``FeedForward`` dense vs the same module with the
   plugin installed, fused and per-Linear (``fuse_gelu: false``), with receipts.
5. Kernel launch sweep: kernel-only times (CUDA graphs) of a few ``BLOCK_M`` x ``num_warps`` settings.
6. Whole forward of the Wan2.1-T2V-1.3B architecture (random seeded weights, bf16, fp32 modules kept as
   diffusers keeps them) at W17 and W81: dense vs this plugin (fused producer, the default) vs this plugin
   per-Linear (``fuse_gelu: false``) vs torchao ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``
   on the same 60 FFN Linears; interleaved paired rounds (more rounds at W17, whose forward is short and noisy),
   medians, latent relative L2 vs dense, execution proof (receipts: every FFN Linear executed ``fp8_gemm`` once
   per forward, every FFN ``fp8_gelu_fused`` once, no fallback, Triton kernels; ``_scaled_mm`` counted) and
   exact restore after uninstall (output and state dict bitwise).

Random weights say nothing about visual quality; the relative L2 figures only describe these weights.

Usage::

    python benchmarks/kernels/selective_fp8.py --out "$OUT"              # H200 (about 3-4 minutes)
    python benchmarks/kernels/selective_fp8.py --smoke --out /tmp/fp8     # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from worldfoundry_selective_fp8.plugin import prepare

from worldfoundry.base_models.diffusion_model.optimizations.plugins import install_diffusion_accelerations
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.kernels.dispatch import quantize_activations_rowwise_fp8
from worldfoundry.core.acceleration.kernels.fp8_rowwise_quant import (
    TRITON_AVAILABLE,
    interpreter_enabled,
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
from worldfoundry.bench.microbench import provenance as shared_provenance
from worldfoundry.bench.microbench import (  # noqa: E402 - shared benchmark helpers
    RANDOM_NOTE,
    SMOKE_WORKLOADS,
    WAN_1_3B,
    WAN_TINY,
    WORKLOADS,
    bf16_wan,
    interleaved,
    rel_l2,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from selective_fp8_ffn import (  # noqa: E402 - the FFN sections live beside this script
    gelu_kernel_check,
    graph_ms,
    kernel_sweep,
    producer_bench,
    whole_ffn_bench,
)

ROOT = Path(__file__).resolve().parents[2]
FFN = ["blocks.*.ffn.net.0.proj", "blocks.*.ffn.net.2"]


class CountScaledMM(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def torchao_config() -> tuple[Any, str | None]:
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except Exception as exc:  # torchao is optional: any import problem skips it
        return None, f"torchao not importable: {type(exc).__name__}: {exc}"
    return (quantize_, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())), None


# ---------------------------------------------------------------------------------------------- sections
def _bitwise(x: torch.Tensor) -> bool:
    rows = quantize_activations_rowwise_fp8(x, backend="triton")
    q_ref, s_ref = quantize_rowwise_fp8(x)
    return bool(torch.equal(rows.q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(rows.scale, s_ref))


def kernel_check(device: torch.device, smoke: bool) -> dict[str, Any]:
    if device.type != "cuda" and not interpreter_enabled():
        return {"skipped": "the Triton kernel needs CUDA (or TRITON_INTERPRET=1 on the CPU)"}
    if not TRITON_AVAILABLE:
        return {"skipped": "triton not importable"}
    shapes = [(7, 48), (33, 100), (4, 2, 64)] if smoke else [
        (1, 16), (17, 1536), (1023, 8960), (4097, 1536), (32760, 1536), (32760, 8960), (5, 20000), (9, 3, 1536)]
    g = torch.Generator(device=device).manual_seed(0)
    results = [{"shape": list(shape),
                "bitwise": _bitwise((torch.randn(*shape, generator=g, device=device) * 3).to(torch.bfloat16))}
               for shape in shapes]
    wide = torch.randn(257, 2048, generator=g, device=device).to(torch.bfloat16)
    results.append({"shape": "strided 257x1536 (row stride 2048)", "bitwise": _bitwise(wide[:, 128:1664])})
    for config in ({"BLOCK_M": 1, "num_warps": 4}, {"BLOCK_M": 8, "num_warps": 16}):  # launch settings: same bytes
        x = (torch.randn(129, 1536, generator=g, device=device) * 3).to(torch.bfloat16)
        q, scale = triton_quantize_rowwise_fp8(x, config=config)
        q_ref, s_ref = quantize_rowwise_fp8(x)
        same = bool(torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, s_ref))
        results.append({"shape": f"[129, 1536] config {config}", "bitwise": same})
    for shape in shapes[-3:]:  # the interpreter's explicit rounding path, run on this device too
        x = (torch.randn(*shape, generator=g, device=device) * 3).to(torch.bfloat16)
        q, scale = triton_quantize_rowwise_fp8(x, software_rounding=True)
        q_ref, s_ref = quantize_rowwise_fp8(x)
        same = bool(torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(scale, s_ref))
        results.append({"shape": f"{list(shape)} software rounding", "bitwise": same})
    return {"cases": results, "all_bitwise": all(r["bitwise"] for r in results)}


def _linear_case(device: torch.device, args: argparse.Namespace, m: int, k: int, n: int,
                 ao: Any, ao_reason: str | None) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(k + n)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    lin = nn.Linear(k, n).to(device, torch.bfloat16).eval()
    w8 = quantize_weight_rowwise_fp8(lin.weight.detach())
    q_pre, s_pre = quantize_rowwise_fp8(x)
    w, b = lin.weight.detach(), lin.bias.detach()

    def eager_path() -> torch.Tensor:
        rows = quantize_activations_rowwise_fp8(x, backend="torch")
        return scaled_mm_rowwise(rows.q, rows.scale, w8, b)

    candidates: dict[str, Callable[[], Any]] = {
        "bf16": lambda: F.linear(x, w, b),
        "plugin (fused quant + _scaled_mm)": lambda: fp8_rowwise_linear(x, w8, b),
        "plugin, use_fast_accum=True": lambda: fp8_rowwise_linear(x, w8, b, use_fast_accum=True),
        "_scaled_mm alone": lambda: scaled_mm_rowwise(q_pre, s_pre, w8, b),
        "eager per-row quant + _scaled_mm": eager_path,
        "quant kernel alone": lambda: quantize_activations_rowwise_fp8(x),
        "eager quant alone": lambda: quantize_activations_rowwise_fp8(x, backend="torch"),
    }
    entry: dict[str, Any] = {"M": m, "K": k, "N": n}
    if ao is not None:
        try:
            ao_lin = copy.deepcopy(lin)
            ao[0](ao_lin, ao[1])
            candidates["torchao float8 rowwise"] = lambda: ao_lin(x)
        except Exception as exc:
            entry["torchao"] = f"failed: {type(exc).__name__}: {exc}"
    else:
        entry["torchao"] = f"skipped: {ao_reason}"
    with torch.inference_mode():
        entry["timing"] = interleaved(candidates, device, rounds=args.rounds, warmup=args.warmup,
                                      iters=args.linear_iters, baseline="bf16")
        dense = F.linear(x, w, b).float()
        fp8 = fp8_rowwise_linear(x, w8, b).float()
        sub = slice(0, min(m, 4096))
        exact = x[sub].double() @ w.double().t() + b.double()
        entry["rel_l2_vs_bf16"] = rel_l2(fp8, dense)
        entry["rel_l2_vs_float64"] = rel_l2(fp8[sub], exact)
        entry["bf16_rel_l2_vs_float64"] = rel_l2(dense[sub], exact)
        if "torchao float8 rowwise" in candidates:
            entry["torchao_rel_l2_vs_bf16"] = rel_l2(candidates["torchao float8 rowwise"]().float(), dense)
    quant_ms = entry["timing"]["quant kernel alone"]["median_ms"]
    entry["quant_kernel_gb_per_s"] = m * k * 3 / (quant_ms * 1e-3) / 1e9  # bf16 read + fp8 write (as called)
    if device.type == "cuda":
        try:  # the kernel alone, replayed from a CUDA graph: no Python/launch overhead
            kernel_ms = graph_ms(lambda: triton_quantize_rowwise_fp8(x))
            entry["quant_kernel_graph_ms"] = kernel_ms
            entry["quant_kernel_graph_gb_per_s"] = m * k * 3 / (kernel_ms * 1e-3) / 1e9
        except Exception as exc:
            entry["quant_kernel_graph_ms"] = f"failed: {type(exc).__name__}: {exc}"
    return entry


def linear_bench(device: torch.device, args: argparse.Namespace) -> list[dict[str, Any]]:
    """W81 rows first (the issue's goal), then W17 rows (where launch overhead shows)."""
    rows = [64] if args.smoke else [args.tokens, args.w17_tokens]
    dims = [(32, 48), (48, 32)] if args.smoke else [(1536, 8960), (8960, 1536)]
    ao, ao_reason = torchao_config() if device.type == "cuda" else (None, "torchao float8 needs CUDA")
    return [_linear_case(device, args, m, k, n, ao, ao_reason) for m in rows for k, n in dims]


build_wan = bf16_wan


PLUGIN_VARIANTS = {"selective_fp8": True, "selective_fp8 per-Linear": False}  # name -> fuse_gelu


def forward_bench(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    config = WAN_TINY if args.smoke else WAN_1_3B
    workloads = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    text_len = 8 if args.smoke else 512
    dense = build_wan(config, device)
    reg = AccelerationRegistry(discover=False)
    reg.register("selective_fp8", prepare)
    candidates_models: dict[str, nn.Module] = {"dense": dense}
    sessions: dict[str, Any] = {}
    for name, fuse in PLUGIN_VARIANTS.items():
        model = copy.deepcopy(dense)
        spec = {"selective_fp8": {"include": FFN, "min_tokens": 1 if args.smoke else 1024, "fuse_gelu": fuse}}
        sessions[name] = install_diffusion_accelerations(model, spec, RuntimePolicy(device=device, dtype="bf16"),
                                                         registry=reg)
        candidates_models[name] = model
    handle = sessions["selective_fp8"].handles("selective_fp8")["model"]
    paths = list(handle.paths)  # the selected Linears
    result: dict[str, Any] = {
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
        "selected_linears": len(paths), "fused_ffns": len(handle.runtime.fused_ffns), "note": RANDOM_NOTE,
    }
    ao, ao_reason = torchao_config() if device.type == "cuda" else (None, "torchao float8 needs CUDA")
    if ao is not None:
        try:
            ao_model = copy.deepcopy(dense)
            wanted = set(paths)
            ao[0](ao_model, ao[1], filter_fn=lambda module, fqn: fqn in wanted)
            candidates_models["torchao"] = ao_model
        except Exception as exc:
            result["torchao"] = f"failed: {type(exc).__name__}: {exc}"
    else:
        result["torchao"] = f"skipped: {ao_reason}"
    result["plugin_memory"] = handle.execution_report()["selective_fp8"]["memory"]
    for wname, latent in workloads.items():
        inputs = wan_inputs(latent, text_len, config["text_dim"], device)
        result[wname] = _forward_case(wname, inputs, latent, candidates_models, sessions, device, args)
    # exact restore: uninstall, then each plugin model must equal the dense one bitwise (same weights)
    inputs = wan_inputs(workloads["W17"], text_len, config["text_dim"], device)
    with torch.inference_mode():
        dense_out = dense(**inputs)[0]
    sd_a = dense.state_dict()
    result["restore"] = {}
    for name, session in sessions.items():
        session.uninstall()
        model = candidates_models[name]
        with torch.inference_mode():
            same_out = torch.equal(model(**inputs)[0], dense_out)
        sd_b = model.state_dict()
        same_state = list(sd_a) == list(sd_b) and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
        result["restore"][name] = {"output_bitwise": same_out, "state_dict_bitwise": same_state}
    return result


def wan_inputs(latent: tuple[int, int, int], text_len: int, text_dim: int, device: torch.device) -> dict[str, Any]:
    f, h, w = latent
    g = torch.Generator(device=device).manual_seed(7)
    return {
        "hidden_states": torch.randn(1, 16, f, h, w, generator=g, device=device).to(torch.bfloat16),
        "timestep": torch.tensor([500], device=device),
        "encoder_hidden_states": torch.randn(1, text_len, text_dim, generator=g, device=device).to(torch.bfloat16),
        "return_dict": False,
    }


def _proof(name: str, model: nn.Module, session: Any, inputs: dict[str, Any], rid: str) -> dict[str, Any]:
    """Receipts and ``_scaled_mm`` count of one plugin forward."""
    handle = session.handles("selective_fp8")["model"]
    paths, fused = list(handle.paths), list(handle.runtime.fused_ffns)
    with CountScaledMM() as counter, request_scope(RequestContext(rid)):
        model(**inputs)
    record = session.execution_report()["plugins"]["selective_fp8"]["model"]["requests"][rid]
    executed_once = all(record["modules"].get(p, {}).get("fp8_gemm") == 1 for p in paths)
    fused_once = all(record["modules"].get(f, {}).get("fp8_gelu_fused") == 1 for f in fused)
    counters = record["counters"]
    reference_calls = counters.get("activation_quant_torch_reference", 0) + counters.get("gelu_quant_torch_reference", 0)
    return {
        "scaled_mm_calls": counter.calls, "expected": len(paths),
        "every_module_fp8_once": executed_once, "fused_ffns": len(fused), "every_fused_ffn_once": fused_once,
        "fallbacks": record["fallbacks"], "skipped": record["skipped"], "torch_reference_quant_calls": reference_calls,
        "ok": (executed_once and fused_once and not record["fallbacks"] and not record["skipped"]
               and counter.calls == len(paths)),
    }


def _forward_case(wname: str, inputs: dict[str, Any], latent: tuple[int, int, int], models: dict[str, nn.Module],
                  sessions: dict[str, Any], device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    f, h, w = latent
    entry: dict[str, Any] = {"latent": [f, h, w], "tokens": f * (h // 2) * (w // 2)}
    with torch.inference_mode():
        outputs = {n: m(**inputs)[0].float() for n, m in models.items()}
        entry["execution_proof"] = {n: _proof(n, models[n], s, inputs, f"{wname}-proof-{n}")
                                    for n, s in sessions.items()}
        for n, out in outputs.items():
            if n != "dense":
                entry[f"latent_rel_l2_{n}_vs_dense"] = rel_l2(out, outputs["dense"])
        if "selective_fp8 per-Linear" in outputs:
            fused, unfused = outputs["selective_fp8"], outputs["selective_fp8 per-Linear"]
            entry["fused_vs_per_linear"] = {"bitwise": bool(torch.equal(fused, unfused)),
                                            "equal_fraction": float((fused == unfused).double().mean()),
                                            "rel_l2": rel_l2(fused, unfused)}
        entry["finite"] = {n: bool(torch.isfinite(o).all()) for n, o in outputs.items()}
        del outputs
        calls = {n: (lambda m=m: m(**inputs)) for n, m in models.items()}
        w81 = wname == "W81"
        entry["timing"] = interleaved(calls, device, rounds=args.rounds if w81 else args.w17_rounds,
                                      warmup=args.warmup, iters=1 if w81 else args.w17_iters, baseline="dense")
    return entry


# ---------------------------------------------------------------------------------------------- report
def provenance(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    return shared_provenance(device, extra_packages=("torchao",), args=vars(args))


def _row(name: str, t: dict[str, Any], baseline: str, width: int) -> str:
    return (f"    {name:{width}s} {t['median_ms']:9.3f} ms  {t['speedup_vs_' + baseline]:5.2f}x "
            f"[{t['paired_speedup_median']:.2f}x]")


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def _print_kernels(data: dict[str, Any]) -> None:
    kc = data.get("kernel_check", {})
    print("quant kernel vs torch reference bitwise:", kc.get("all_bitwise", kc.get("skipped", kc)))
    gk = data.get("gelu_kernel_check", {})
    if "cases" in gk:
        print(f"GELU-quant kernel: quantization bitwise {gk['all_quantization_bitwise']}; activation within bound "
              f"{gk.get('activation_within_bound')} (error/bound {gk['max_error_over_bound_kernel']:.3f}); bitwise vs "
              f"torch GELU {gk['activation_bitwise_vs_torch_gelu']} (min equal fraction "
              f"{gk['min_activation_equal_fraction']:.6f}, max {gk['max_activation_ulp']} bf16 ulp; not claimed)")
    else:
        print("GELU-quant kernel:", gk.get("skipped", gk))


def _print_linears(data: dict[str, Any]) -> None:
    print("\nper FFN Linear, strict (median ms, speedup vs bf16; paired-round median in brackets)")
    for e in data.get("linear", []) if isinstance(data.get("linear"), list) else []:
        print(f"  M={e['M']} {e['K']}->{e['N']}  rel L2 vs bf16 {e['rel_l2_vs_bf16']:.4f}  vs fp64 "
              f"{e['rel_l2_vs_float64']:.4f} (bf16 {e['bf16_rel_l2_vs_float64']:.4f})  quant "
              f"{e['quant_kernel_gb_per_s']:.0f} GB/s as called, "
              f"{_fmt(e.get('quant_kernel_graph_gb_per_s', 'n/a'), '.0f')} GB/s kernel only")
        for name, t in e["timing"].items():
            print(_row(name, t, "bf16", 36))
    pb = data.get("ffn_down_with_producer")
    if isinstance(pb, dict) and "timing" in pb:
        base = "dense: torch GELU + bf16 Linear"
        print(f"\nFFN down with producer, M={pb['M']} {pb['K']}->{pb['N']} (vs dense GELU + bf16 Linear); fused vs "
              f"dense rel L2 {pb['rel_l2_fused_vs_dense']:.4f}, fused == per-Linear "
              f"{pb['fused_equals_per_linear_fraction']:.6f}; fused kernel "
              f"{_fmt(pb.get('fused_kernel_gb_per_s', 'n/a'), '.0f')} GB/s kernel only "
              f"({pb.get('kernel_only_ms', 'n/a')})")
        for name, t in pb["timing"].items():
            print(_row(name, t, base, 58))
    wf = data.get("whole_ffn")
    if isinstance(wf, dict) and "timing" in wf:
        print(f"\nwhole FFN (up + GELU + down), M={wf['M']} {wf['dim']}->{wf['inner']}->{wf['dim']}")
        for name, t in wf["timing"].items():
            print(_row(name, t, "dense FeedForward", 40))
    sw = data.get("kernel_sweep", {})
    for label, case in (sw.items() if isinstance(sw, dict) else ()):
        if not isinstance(case, dict) or "settings" not in case:
            continue
        cells = [f"{r['BLOCK_M']}x{r['num_warps']}w "
                 + (f"{r['ms']:.3f}ms {r['gb_per_s']:.0f}GB/s" if "gb_per_s" in r else "err")
                 + ("*" if r.get("default") else "") for r in case["settings"]]
        print(f"  sweep {label}: {'  '.join(cells)}  (* default)")


def print_tables(data: dict[str, Any]) -> None:
    prov = data["provenance"]
    print(f"\n== selective_fp8 on {prov['gpu'] or prov['device']} (torch {prov['torch']}, triton {prov['triton']}) ==")
    _print_kernels(data)
    _print_linears(data)
    fw = data.get("forward", {})
    if isinstance(fw, dict) and "selected_linears" in fw:
        print(f"\nwhole forward, {fw['selected_linears']} FFN Linears, {fw['fused_ffns']} fused FFNs ({fw['note']}); "
              f"torchao: {fw.get('torchao', 'ran')}")
        for wname in WORKLOADS:
            e = fw.get(wname)
            if not e:
                continue
            proofs = "  ".join(f"{n}: ok={p['ok']} (_scaled_mm {p['scaled_mm_calls']}/{p['expected']})"
                               for n, p in e["execution_proof"].items())
            l2 = "  ".join(f"{k.replace('latent_rel_l2_', '').replace('_vs_dense', '')} rel L2 {v:.4f}"
                           for k, v in e.items() if k.startswith("latent_rel_l2_"))
            print(f"  {wname} ({e['tokens']} tokens)  {proofs}\n    {l2}  fused vs per-Linear "
                  f"{e.get('fused_vs_per_linear')}")
            for name, t in e["timing"].items():
                print(_row(name, t, "dense", 26))
        extra = fw["plugin_memory"]["extra_bytes"] / 2**20
        print(f"  restore after uninstall: {fw['restore']}  extra memory {extra:.1f} MiB")
    for section, error in data.get("errors", {}).items():
        print(f"\n!! section {section} failed: {error.splitlines()[-1] if error else error}")


def _run_section(data: dict[str, Any], name: str, fn: Callable[[], Any], out: Path) -> None:
    """Run one section; a failure is recorded under ``errors`` instead of ending the run. Writes the JSON."""
    start = time.perf_counter()
    try:
        data[name] = fn()
    except Exception:
        data.setdefault("errors", {})[name] = traceback.format_exc()
        print(f"section {name} failed:\n{data['errors'][name]}", file=sys.stderr)
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    data.setdefault("section_seconds", {})[name] = round(time.perf_counter() - start, 1)
    (out / "selective_fp8.json").write_text(json.dumps(data, indent=2, default=str))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for selective_fp8.json (default $OUT)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--rounds", type=int, default=7, help="paired rounds (Linear/FFN sections and W81)")
    p.add_argument("--w17-rounds", type=int, default=21, help="paired rounds at W17 (short, noisy forward)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32760, help="rows of the per-Linear benchmark (W81 tokens)")
    p.add_argument("--w17-tokens", type=int, default=3600, help="rows of the W17 per-Linear cases")
    p.add_argument("--linear-iters", type=int, default=10, help="calls per timed sample in the Linear benchmark")
    p.add_argument("--w17-iters", type=int, default=3, help="forwards per timed sample at W17")
    p.add_argument("--skip-forward", action="store_true")
    p.add_argument("--skip-sweep", action="store_true", help="skip the kernel launch-setting sweep")
    args = p.parse_args(argv)
    if not args.out:
        p.error("--out is required (or set $OUT)")
    if args.rounds < 3 or args.w17_rounds < 3:
        p.error("--rounds and --w17-rounds must be at least 3")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        args.rounds, args.w17_rounds, args.warmup, args.linear_iters, args.w17_iters = 3, 3, 1, 2, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"provenance": provenance(args, device)}
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("kernel_check", lambda: kernel_check(device, args.smoke)),
        ("gelu_kernel_check", lambda: gelu_kernel_check(device, args.smoke)),
        ("linear", lambda: linear_bench(device, args)),
        ("ffn_down_with_producer", lambda: producer_bench(device, args)),
        ("whole_ffn", lambda: whole_ffn_bench(device, args)),
    ]
    if not args.skip_sweep:
        sections.append(("kernel_sweep", lambda: kernel_sweep(device, args)))
    if not args.skip_forward:
        sections.append(("forward", lambda: forward_bench(device, args)))
    for name, fn in sections:
        _run_section(data, name, fn, out)
    print_tables(data)
    print(f"\nwrote {out / 'selective_fp8.json'}")
    return 1 if data.get("errors") else 0


if __name__ == "__main__":
    raise SystemExit(main())
