"""GPU evidence for ``selective_fp8``: the fused activation-quant kernel, one FFN Linear, and the whole forward.

One run does everything, in this order:

1. Kernel check: the Triton rowwise quantizer equals its torch reference bitwise (FP8 bytes and scales) on
   many shapes (odd, large, strided rows), plus its effective bandwidth at the W81 FFN shapes.
2. Per FFN Linear at W81 shapes (M = 32,760 tokens, Wan2.1-1.3B dims 1536 -> 8960 and 8960 -> 1536):
   bf16 ``F.linear`` vs the plugin path (fused quant + ``torch._scaled_mm`` + bias), ``_scaled_mm`` alone
   (activations pre-quantized), eager per-row quantization + ``_scaled_mm``, and torchao's float8 rowwise
   Linear when importable; interleaved paired rounds, medians; relative L2 against bf16 and float64.
3. Whole forward of the Wan2.1-T2V-1.3B architecture (random seeded weights, bf16, fp32 modules kept as
   diffusers keeps them) at W17 and W81: dense vs this plugin vs torchao
   ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` on the same 60 FFN Linears;
   interleaved paired rounds, medians, latent relative L2 vs dense, execution proof (receipts: every FFN
   Linear executed ``fp8_gemm`` once per forward, no fallback, Triton quantizer; ``_scaled_mm`` counted) and
   exact restore after uninstall (output and state dict bitwise).

Random weights say nothing about visual quality; the relative L2 figures only describe these weights.

Usage::

    python benchmarks/kernels/selective_fp8.py --out "$OUT"              # H200 (about 2 minutes)
    python benchmarks/kernels/selective_fp8.py --smoke --out /tmp/fp8     # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import copy
import json
import os
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
    interleaved,
    rel_l2,
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
    entry["quant_kernel_gb_per_s"] = m * k * 3 / (quant_ms * 1e-3) / 1e9  # bf16 read + fp8 write
    return entry


def linear_bench(device: torch.device, args: argparse.Namespace) -> list[dict[str, Any]]:
    m = 64 if args.smoke else args.tokens
    dims = [(32, 48), (48, 32)] if args.smoke else [(1536, 8960), (8960, 1536)]
    ao, ao_reason = torchao_config() if device.type == "cuda" else (None, "torchao float8 needs CUDA")
    return [_linear_case(device, args, m, k, n, ao, ao_reason) for k, n in dims]


def build_wan(config: dict[str, Any], device: torch.device, seed: int = 0) -> nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = WanTransformer3DModel(**config)
    keep = list(getattr(type(model), "_keep_in_fp32_modules", None) or [])
    with torch.no_grad():  # bf16, except the tensors diffusers keeps in fp32 when loading with torch_dtype=bf16
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point():
                fp32 = any(k in name.split(".") for k in keep)
                tensor.data = tensor.data.to(torch.float32 if fp32 else torch.bfloat16)
    return model.eval()


def forward_bench(device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    config = WAN_TINY if args.smoke else WAN_1_3B
    workloads = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    text_len = 8 if args.smoke else 512
    dense = build_wan(config, device)
    plugin_model = copy.deepcopy(dense)
    reg = AccelerationRegistry(discover=False)
    reg.register("selective_fp8", prepare)
    spec = {"selective_fp8": {"include": FFN, "min_tokens": 1 if args.smoke else 1024}}
    session = install_diffusion_accelerations(plugin_model, spec, RuntimePolicy(device=device, dtype="bf16"),
                                              registry=reg)
    paths = [p for p in session.receipt.plugins[0].claims if not p.startswith("role:")]
    candidates_models: dict[str, nn.Module] = {"dense": dense, "selective_fp8": plugin_model}
    result: dict[str, Any] = {
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
        "selected_linears": len(paths), "note": RANDOM_NOTE,
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
    handle = session.handles("selective_fp8")["model"]
    result["plugin_memory"] = handle.execution_report()["selective_fp8"]["memory"]
    for wname, latent in workloads.items():
        inputs = wan_inputs(latent, text_len, config["text_dim"], device)
        result[wname] = _forward_case(wname, inputs, latent, candidates_models, session, paths, device, args)
    # exact restore: uninstall, then the plugin model must equal the dense one bitwise (same weights)
    session.uninstall()
    inputs = wan_inputs(workloads["W17"], text_len, config["text_dim"], device)
    with torch.inference_mode():
        same_out = torch.equal(plugin_model(**inputs)[0], dense(**inputs)[0])
    sd_a, sd_b = dense.state_dict(), plugin_model.state_dict()
    same_state = list(sd_a) == list(sd_b) and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    result["restore"] = {"output_bitwise": same_out, "state_dict_bitwise": same_state}
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


def _forward_case(wname: str, inputs: dict[str, Any], latent: tuple[int, int, int], models: dict[str, nn.Module],
                  session: Any, paths: list[str], device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    f, h, w = latent
    entry: dict[str, Any] = {"latent": [f, h, w], "tokens": f * (h // 2) * (w // 2)}
    with torch.inference_mode():
        outputs = {n: m(**inputs)[0].float() for n, m in models.items()}
        rid = f"{wname}-proof"
        with CountScaledMM() as counter, request_scope(RequestContext(rid)):
            models["selective_fp8"](**inputs)
        record = session.execution_report()["plugins"]["selective_fp8"]["model"]["requests"][rid]
        executed_once = all(record["modules"].get(p, {}).get("fp8_gemm") == 1 for p in paths)
        entry["execution_proof"] = {
            "scaled_mm_calls": counter.calls, "expected": len(paths),
            "every_module_fp8_once": executed_once, "fallbacks": record["fallbacks"],
            "torch_reference_quant_calls": record["counters"].get("activation_quant_torch_reference", 0),
            "ok": executed_once and not record["fallbacks"] and counter.calls == len(paths),
        }
        for n, out in outputs.items():
            if n != "dense":
                entry[f"latent_rel_l2_{n}_vs_dense"] = rel_l2(out, outputs["dense"])
        entry["finite"] = {n: bool(torch.isfinite(o).all()) for n, o in outputs.items()}
        del outputs
        calls = {n: (lambda m=m: m(**inputs)) for n, m in models.items()}
        entry["timing"] = interleaved(calls, device, rounds=args.rounds, warmup=args.warmup,
                                      iters=1 if wname == "W81" else args.w17_iters, baseline="dense")
    return entry


# ---------------------------------------------------------------------------------------------- report
def provenance(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    return shared_provenance(device, extra_packages=("torchao",), args=vars(args))


def _row(name: str, t: dict[str, Any], baseline: str, width: int) -> str:
    return (f"    {name:{width}s} {t['median_ms']:9.3f} ms  {t['speedup_vs_' + baseline]:5.2f}x "
            f"[{t['paired_speedup_median']:.2f}x]")


def print_tables(data: dict[str, Any]) -> None:
    prov = data["provenance"]
    print(f"\n== selective_fp8 on {prov['gpu'] or prov['device']} (torch {prov['torch']}, triton {prov['triton']}) ==")
    kc = data["kernel_check"]
    print("kernel vs torch reference bitwise:", kc.get("all_bitwise", kc.get("skipped")))
    print("\nper FFN Linear (median ms, speedup vs bf16; paired-round median in brackets)")
    for e in data.get("linear", []):
        print(f"  M={e['M']} {e['K']}->{e['N']}  rel L2 vs bf16 {e['rel_l2_vs_bf16']:.4f}  vs fp64 "
              f"{e['rel_l2_vs_float64']:.4f} (bf16 {e['bf16_rel_l2_vs_float64']:.4f})  "
              f"quant {e['quant_kernel_gb_per_s']:.0f} GB/s")
        for name, t in e["timing"].items():
            print(_row(name, t, "bf16", 36))
    fw = data.get("forward", {})
    if not fw:
        return
    print(f"\nwhole forward, {fw['selected_linears']} FFN Linears ({fw['note']}); torchao: {fw.get('torchao', 'ran')}")
    for wname in WORKLOADS:
        e = fw.get(wname)
        if not e:
            continue
        proof = e["execution_proof"]
        l2 = "  ".join(f"{k.replace('latent_rel_l2_', '').replace('_vs_dense', '')} rel L2 {v:.4f}"
                       for k, v in e.items() if k.startswith("latent_rel_l2_"))
        print(f"  {wname} ({e['tokens']} tokens)  proof ok={proof['ok']} "
              f"(_scaled_mm {proof['scaled_mm_calls']}/{proof['expected']})  {l2}")
        for name, t in e["timing"].items():
            print(_row(name, t, "dense", 14))
    extra = fw["plugin_memory"]["extra_bytes"] / 2**20
    print(f"  restore after uninstall: {fw['restore']}  extra memory {extra:.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for selective_fp8.json (default $OUT)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32760, help="rows of the per-Linear benchmark (W81 tokens)")
    p.add_argument("--linear-iters", type=int, default=10, help="calls per timed sample in the Linear benchmark")
    p.add_argument("--w17-iters", type=int, default=3, help="forwards per timed sample at W17")
    p.add_argument("--skip-forward", action="store_true")
    args = p.parse_args(argv)
    if not args.out:
        p.error("--out is required (or set $OUT)")
    if args.rounds < 3:
        p.error("--rounds must be at least 3")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        args.rounds, args.warmup, args.linear_iters, args.w17_iters = 3, 1, 2, 1
    data: dict[str, Any] = {"provenance": provenance(args, device)}
    data["kernel_check"] = kernel_check(device, args.smoke)
    data["linear"] = linear_bench(device, args)
    if not args.skip_forward:
        data["forward"] = forward_bench(device, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "selective_fp8.json").write_text(json.dumps(data, indent=2, default=str))
    print_tables(data)
    print(f"\nwrote {out / 'selective_fp8.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
