"""Attention providers on one GPU, side by side: per-layer time and accuracy, and the Wan W81 forward with
``attention_policy`` routing self-attention to FlashAttention-3.

One process, three parts (each fails alone, printed; the others still run):

* ``layer`` — B1 H12 D128 bf16 at W17 self (S 3,600), W81 self (S 32,760) and W81 cross (Sq 32,760, Skv 512):
  PyTorch SDPA default / flash / cuDNN, ``fa3`` (fa3-fwd) and ``sage`` (sageattention 1.0.6); interleaved rounds,
  medians, relative L2 to an fp32 reference (chunked fp32 matmul + softmax, TF32 off). Inputs are the
  transposed views of tokens-major tensors, as diffusers' dispatcher passes them to SDPA.
* ``forward`` — ``WanTransformer3DModel`` with the Wan2.1-1.3B config (30 layers, dim 1536, 12 heads, FFN 8960),
  random seeded weights, bf16 (fp32 modules kept as diffusers keeps them), latent 1x16x21x60x104, text 512x4096:
  ``eager`` vs ``attention_policy{self: fa3, min_tokens 8192}`` (and ``sage`` alike when installed) and
  ``eager[copy]`` (a second dense instance: the cross-instance noise floor) and the anchor ``compile_regional``
  (diffusers' ``compile_repeated_blocks``, compile time reported apart), ≥ 3 interleaved paired rounds,
  medians; latent relative L2 of every variant to an fp32-attention reference forward (the same bf16 model with
  every attention computed in fp32 through ``attention_policy``). Receipts prove the provider ran.
* ``w17`` — the same at W17 (S 3,600 < min_tokens): the policy falls back on every call, so its output must be
  bitwise the eager output, and its time shows the wrapper's overhead.

Goal: W81 forward with fa3 ≥ 1.12x eager, relative L2 to the reference no worse than eager's (≤ 1.05x, the margin
for run-to-run noise of random data is stated, not hidden). Random weights: relative L2 describes these weights
only, not visual quality.

Run (H200, about 2-3 minutes)::

    python benchmarks/kernels/attention_providers.py --out "$OUT"
    python benchmarks/kernels/attention_providers.py --smoke --out /tmp/ap    # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
for _sub in ("plugins/attention_policy/src", "plugins/attention_fa3/src", "plugins/attention_sage/src"):
    if str(ROOT / _sub) not in sys.path:
        sys.path.append(str(ROOT / _sub))  # only used when the distributions are not installed

from worldfoundry.bench.microbench import (  # noqa: E402
    RANDOM_NOTE,
    SMOKE_WORKLOADS,
    WAN_1_3B,
    WAN_TINY,
    WORKLOADS,
    interleaved,
    provenance,
    rel_l2,
    sync,
)
from worldfoundry.core.acceleration.context import RequestContext, request_scope  # noqa: E402
from worldfoundry.core.acceleration.guard import attach_request_guard  # noqa: E402
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations  # noqa: E402
from worldfoundry.core.acceleration.registry import AccelerationRegistry  # noqa: E402
from worldfoundry.core.attention.provider_registry import AttentionProviderRegistry  # noqa: E402
from worldfoundry.core.attention.providers import EXACT_EQUIVALENT, AttentionProvider  # noqa: E402
from worldfoundry.core.model_loading.dtypes import apply_dtype_policy  # noqa: E402

LAYER_PROVIDERS = ("sdpa", "sdpa_flash", "sdpa_cudnn", "fa3", "sage")
POLICY_PROVIDERS = ("fa3", "sage")
MIN_TOKENS = 8192
TEXT_TOKENS = 512
SPEED_GOAL = 1.12
ACCURACY_MARGIN = 1.05


# ---------------------------------------------------------------------------------------------- providers
def fp32_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Softmax attention in float32 over query chunks (TF32 off); returned in float32."""
    if attn_mask is not None or dropout_p or is_causal:
        raise ValueError("the fp32 reference takes no mask, dropout or causal flag")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    k, v = key.float(), value.float()
    chunk = max(1, 2**29 // max(1, query.shape[0] * query.shape[1] * key.shape[-2]))
    out = torch.empty(*query.shape[:-1], value.shape[-1], dtype=torch.float32, device=query.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for start in range(0, query.shape[-2], chunk):
            q = query[..., start:start + chunk, :].float()
            out[..., start:start + chunk, :] = torch.softmax((q @ k.transpose(-2, -1)) * scale, dim=-1) @ v
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return out


def reference_provider() -> AttentionProvider:
    return AttentionProvider(name="fp32_reference", version="1", numerics=EXACT_EQUIVALENT,
                             attention=lambda q, k, v, **kw: fp32_attention(q, k, v, **kw).to(q.dtype),
                             device_types=("cpu", "cuda"), description="benchmark reference: attention in fp32")


def build_providers() -> tuple[AttentionProviderRegistry, dict[str, str]]:
    """Built-ins, fa3, sage (when their distributions import) and the fp32 reference; name -> why missing."""
    registry = AttentionProviderRegistry(discover=False)
    registry.register(reference_provider())
    missing: dict[str, str] = {}
    for name, module, factory in (("fa3", "worldfoundry_attention_fa3.provider", "fa3_provider"),
                                  ("sage", "worldfoundry_attention_sage.provider", "sage_provider")):
        try:
            registry.register(getattr(__import__(module, fromlist=[factory]), factory)())
        except Exception as exc:  # noqa: BLE001 - reported, the rest runs
            missing[name] = f"provider distribution not importable: {exc}"
    return registry, missing


def probe_all(registry: AttentionProviderRegistry, missing: dict[str, str], device: torch.device,
              dtype: torch.dtype) -> dict[str, str | None]:
    reasons: dict[str, str | None] = {}
    for name in LAYER_PROVIDERS:
        reasons[name] = missing.get(name) or (registry.get(name).probe(device, dtype, 128)
                                              if name in registry else "not registered")
        if reasons[name] is not None:
            print(f"skip {name}: {reasons[name]}", flush=True)
    return reasons


# ---------------------------------------------------------------------------------------------- layer part
def layer_part(device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
               registry: AttentionProviderRegistry, reasons: dict[str, str | None]) -> dict[str, Any]:
    tokens = {"W17": 3600, "W81": 32760} if not args.smoke else {"W17": 64, "W81": 160}
    heads, dim = (12, 128) if not args.smoke else (2, 64)
    shapes = {"self_W17": (tokens["W17"], tokens["W17"]), "self_W81": (tokens["W81"], tokens["W81"]),
              "cross_W81": (tokens["W81"], TEXT_TOKENS if not args.smoke else 16)}
    usable = [n for n in LAYER_PROVIDERS if reasons[n] is None]
    result: dict[str, Any] = {"heads": heads, "head_dim": dim, "skipped": {n: r for n, r in reasons.items() if r}}
    for shape, (sq, sk) in shapes.items():
        g = torch.Generator(device=device).manual_seed(sq + sk)
        q = torch.randn(1, sq, heads, dim, generator=g, device=device).to(dtype).transpose(1, 2)
        k, v = (torch.randn(1, sk, heads, dim, generator=g, device=device).to(dtype).transpose(1, 2)
                for _ in range(2))
        reference = fp32_attention(q, k, v)
        entry: dict[str, Any] = {"query_tokens": sq, "key_tokens": sk, "rel_l2_vs_fp32": {}}
        calls = {}
        for name in usable:
            fn = registry.get(name).attention
            entry["rel_l2_vs_fp32"][name] = rel_l2(fn(q, k, v).float(), reference)
            calls[name] = (lambda fn=fn: fn(q, k, v))
        del reference
        iters = args.layer_iters if sq * sk < 10**8 else max(1, args.layer_iters // 10)
        entry["timing"] = interleaved(calls, device, rounds=args.rounds, warmup=args.warmup, iters=iters,
                                      baseline="sdpa")
        flops = 4 * heads * sq * sk * dim
        entry["tflops"] = {n: flops / (t["median_ms"] * 1e-3) / 1e12 for n, t in entry["timing"].items()}
        result[shape] = entry
    return result


# ---------------------------------------------------------------------------------------------- forward part
def build_wan(config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    with torch.device(device):
        model = WanTransformer3DModel(**config)
    return apply_dtype_policy(model, dtype).eval()


def make_inputs(config: dict[str, Any], latent: tuple[int, int, int], text_len: int, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(7)
    f, h, w = latent
    return {"hidden_states": torch.randn(1, 16, f, h, w, generator=g, device=device).to(dtype),
            "timestep": torch.tensor([500], device=device),
            "encoder_hidden_states": torch.randn(1, text_len, config["text_dim"], generator=g, device=device).to(dtype),
            "return_dict": False}


def policy_registry(providers: AttentionProviderRegistry) -> AccelerationRegistry:
    from worldfoundry_attention_policy.options import Options
    from worldfoundry_attention_policy.plugin import make_prepare

    registry = AccelerationRegistry(discover=False)
    registry.register("attention_policy", make_prepare(providers), options=Options)
    return registry


def reference_output(model: torch.nn.Module, registry: AccelerationRegistry,
                     forward: Any) -> torch.Tensor:
    """The forward of ``model`` with every attention computed in fp32 (through ``attention_policy``), in fp32."""
    session = install_diffusion_accelerations(
        model, {"attention_policy": {"self": "fp32_reference", "cross": "fp32_reference"}}, registry=registry)
    try:
        return forward(model).float()
    finally:
        session.uninstall()


def forward_part(workload: str, device: torch.device, dtype: torch.dtype, args: argparse.Namespace,
                 providers: AttentionProviderRegistry, reasons: dict[str, str | None]) -> dict[str, Any]:
    config = WAN_TINY if args.smoke else WAN_1_3B
    latent = (SMOKE_WORKLOADS if args.smoke else WORKLOADS)[workload]
    text_len = 16 if args.smoke else TEXT_TOKENS
    min_tokens = 32 if args.smoke else MIN_TOKENS
    inputs = make_inputs(config, latent, text_len, device, dtype)
    registry = policy_registry(providers)
    result: dict[str, Any] = {}
    dense = build_wan(config, device, dtype)
    names = [n for n in POLICY_PROVIDERS + (("sdpa_math",) if args.smoke else ()) if reasons.get(n) is None]
    result["skipped"] = {n: reasons[n] for n in POLICY_PROVIDERS if reasons.get(n) is not None}
    anchors = ("compile_regional",) if args.compile else ()
    copies = {n: copy.deepcopy(dense) for n in ("reference", "eager[copy]", *names, *anchors)}  # before any guard
    result: dict[str, Any] = {"latent": list(latent), "tokens": latent[0] * latent[1] * latent[2] // 4,
                              "text_tokens": text_len, "min_tokens": min_tokens, **result}

    def forward(model: torch.nn.Module, rid: str | None = None) -> torch.Tensor:
        with torch.no_grad():
            if rid is None:
                return model(**inputs)[0]
            with request_scope(RequestContext(rid)):
                return model(**inputs)[0]

    reference = reference_output(copies.pop("reference"), registry, forward)
    attach_request_guard(dense)
    attach_request_guard(copies["eager[copy]"])
    models: dict[str, torch.nn.Module] = {"eager": dense, "eager[copy]": copies.pop("eager[copy]")}
    sessions = {}
    for name in names:  # smoke: sdpa_math exercises the policy path
        model = copies.pop(name)
        sessions[name] = install_diffusion_accelerations(
            model, {"attention_policy": {"self": {"backend": name, "min_tokens": min_tokens}}}, registry=registry)
        models[f"policy_{name}"] = model
    for name in anchors:  # torch.compile regional (diffusers' compile_repeated_blocks): the anchor to beat
        model = copies.pop(name)
        try:
            t0 = time.perf_counter()
            model.compile_repeated_blocks(fullgraph=True)
            forward(model), forward(model)
            sync(device)
            result["compile_first_two_calls_s"] = time.perf_counter() - t0
            models[name] = model
        except Exception:  # noqa: BLE001 - the anchor failing must not lose the provider comparison
            result.setdefault("errors", {})[name] = traceback.format_exc()[-2000:]
            print(result["errors"][name], file=sys.stderr, flush=True)
    outputs = {}
    for name in list(models):
        try:
            outputs[name] = forward(models[name], rid="proof")
        except Exception:  # noqa: BLE001 - a failing provider variant must not lose the others
            if name in ("eager", "eager[copy]"):
                raise
            result.setdefault("errors", {})[name] = traceback.format_exc()[-2000:]
            print(result["errors"][name], file=sys.stderr, flush=True)
            del models[name]
            session = sessions.pop(name.removeprefix("policy_"), None)
            if session is not None:
                session.uninstall()
    result["rel_l2_vs_fp32_attention"] = {n: rel_l2(o.float(), reference) for n, o in outputs.items()}
    result["bitwise_equal_to_eager"] = {n: bool(torch.equal(o, outputs["eager"])) for n, o in outputs.items()}
    result["receipts"] = {}
    for name, session in sessions.items():
        record = session.execution_report()["plugins"]["attention_policy"]["model"]["requests"]["proof"]
        result["receipts"][name] = {k: record[k] for k in ("counters", "fallbacks", "claimed_not_executed")}
    del outputs, reference
    calls = {name: (lambda m=m: forward(m)) for name, m in models.items()}
    iters = args.w81_iters if workload == "W81" else args.w17_iters
    result["timing"] = interleaved(calls, device, rounds=args.rounds, warmup=args.warmup, iters=iters,
                                   baseline="eager")
    for session in sessions.values():
        session.uninstall()
    return result


def goal(data: dict[str, Any]) -> dict[str, Any] | None:
    w81 = data.get("forward_W81")
    if not isinstance(w81, dict) or "policy_fa3" not in w81.get("timing", {}):
        return None
    speed = w81["timing"]["policy_fa3"]["speedup_vs_eager"]
    err, base = w81["rel_l2_vs_fp32_attention"]["policy_fa3"], w81["rel_l2_vs_fp32_attention"]["eager"]
    executed = w81["receipts"]["fa3"]["claimed_not_executed"] == []  # sessions are keyed by provider name
    return {"speedup": speed, "speed_goal": SPEED_GOAL, "rel_l2_fa3": err, "rel_l2_eager": base,
            "accuracy_margin": ACCURACY_MARGIN, "executed": executed,
            "met": bool(speed >= SPEED_GOAL and err <= ACCURACY_MARGIN * base and executed)}


# ---------------------------------------------------------------------------------------------- report
def print_table(data: dict[str, Any]) -> None:
    print("\n== one attention layer (median ms, rel L2 vs fp32) ==")
    layer = data.get("layer", {})
    for shape in ("self_W17", "self_W81", "cross_W81"):
        entry = layer.get(shape)
        if not isinstance(entry, dict):
            continue
        cells = [f"{n} {t['median_ms']:.3f} ({t['speedup_vs_sdpa']:.2f}x, {entry['rel_l2_vs_fp32'][n]:.3e})"
                 for n, t in entry["timing"].items()]
        print(f"{shape:10s} " + " | ".join(cells))
    for workload in ("W17", "W81"):
        entry = data.get(f"forward_{workload}")
        if not isinstance(entry, dict) or "timing" not in entry:
            continue
        print(f"\n== {workload} forward (median ms, paired speedup vs eager, rel L2 vs fp32-attention forward) ==")
        for name, t in entry["timing"].items():
            print(f"{name:14s} {t['median_ms']:9.2f} ms  {t['paired_speedup_median']:.3f}x "
                  f"[{t['paired_speedup_min']:.3f}, {t['paired_speedup_max']:.3f}]  rel L2 "
                  f"{entry['rel_l2_vs_fp32_attention'][name]:.3e}  bitwise=eager: "
                  f"{entry['bitwise_equal_to_eager'][name]}")
        for name, receipt in entry.get("receipts", {}).items():
            print(f"  receipts {name}: {receipt}")
    if data.get("goal"):
        print(f"\ngoal (W81 fa3 >= {SPEED_GOAL}x eager, rel L2 <= {ACCURACY_MARGIN} x eager's): {data['goal']}")
    for part, error in data.get("errors", {}).items():
        print(f"\nFAILED {part}: {error.strip().splitlines()[-1]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "./bench_out"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layer-iters", type=int, default=50)
    p.add_argument("--w17-iters", type=int, default=5)
    p.add_argument("--w81-iters", type=int, default=1)
    p.add_argument("--parts", default="layer,forward,w17")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="skip the torch.compile regional anchor of the forward parts")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds must be at least 3")
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.warmup, args.layer_iters, args.w17_iters, args.compile = 1, 2, 1, False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {"provenance": provenance(device, extra_packages=("diffusers", "fa3-fwd", "sageattention"),
                                                     dtype=str(dtype), smoke=args.smoke), "note": RANDOM_NOTE}
    providers, missing = build_providers()
    reasons = probe_all(providers, missing, device, dtype)
    data["probe"] = reasons
    parts = {"layer": lambda: layer_part(device, dtype, args, providers, reasons),
             "forward": lambda: forward_part("W81", device, dtype, args, providers, reasons),
             "w17": lambda: forward_part("W17", device, dtype, args, providers, reasons)}
    keys = {"layer": "layer", "forward": "forward_W81", "w17": "forward_W17"}
    for part in [s.strip() for s in args.parts.split(",") if s.strip()]:
        t0 = time.perf_counter()
        try:
            data[keys[part]] = parts[part]()
        except Exception:  # noqa: BLE001 - one failing part must not lose the others
            data.setdefault("errors", {})[part] = traceback.format_exc()[-4000:]
            print(data["errors"][part], file=sys.stderr, flush=True)
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
            sync(device)
        data.setdefault("part_wall_s", {})[part] = time.perf_counter() - t0
        (out / "attention_providers.json").write_text(json.dumps(data, indent=2, default=str))
    data["goal"] = goal(data)
    (out / "attention_providers.json").write_text(json.dumps(data, indent=2, default=str))
    print_table(data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
