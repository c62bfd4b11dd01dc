"""``worldfoundry estimate-residency``: measure one block (compute c, transfer d) and write the r config.

Example:
    worldfoundry estimate-residency --recipe wan2.1-t2v-1.3b --random-weights --frames 17 --height 320 \\
        --width 576 --device cuda --out save_results/

writes ``save_results/resident_blocks_config.json`` (pass it as
``{"resident_blocks": {"config": "save_results/resident_blocks_config.json"}}``) and a report
(``resident_blocks_report.json`` / ``.md``). On the CPU the measurement runs in emulated mode (for testing).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from worldfoundry.cli.checks import check_device, check_input_dir, check_input_file, check_output_dir, usage_error

DEFAULT_OUT = "save_results"


def add_parser(subparsers: Any) -> None:
    """Add the ``estimate-residency`` sub-parser (``func=run``)."""
    p = subparsers.add_parser(
        "estimate-residency",
        help="measure one DiT block (compute c, host-to-device d) and write the resident_blocks config",
        description="Measure the compute time c and the pinned host-to-device transfer time d of one real block "
                    "of the recipe's DiT at the request's shape, then write the resident_blocks config with the "
                    "smallest r for which the two-slot copy schedule predicts no compute wait (--rule budget: the "
                    "smallest r with (N - r) * d <= N * c), and a report. Re-estimate when the device, "
                    "weights, shape, dtype, layout or kernels change.",
    )
    p.add_argument("--recipe", required=True, help="recipe name or YAML path, or a diffusers transformer config.json")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint-dir", default=None, help="local diffusers-format directory (reads one block)")
    weights.add_argument("--random-weights", action="store_true", help="seeded random weights for the block")
    p.add_argument("--frames", type=int, default=None, help="video frames of the request (recipe default if omitted)")
    p.add_argument("--height", type=int, default=None, help="video height in pixels (recipe default if omitted)")
    p.add_argument("--width", type=int, default=None, help="video width in pixels (recipe default if omitted)")
    p.add_argument("--sequence-length", type=int, default=None,
                   help="MiniMax-H3 packed rows (default: text rows + video rows of the size)")
    p.add_argument("--device", default=None, help="cuda, cuda:1, or cpu (emulated); default cuda when available")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype of the block (default bfloat16)")
    p.add_argument("--contiguous", action="store_true",
                   help="measure d with one contiguous slab per block (cpu_offload_block_contiguous=true)")
    p.add_argument("--block-index", type=int, default=0, help="which block to measure (default 0)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before sampling (default 3)")
    p.add_argument("--samples", type=int, default=10, help="timed samples; the median is used (default 10)")
    p.add_argument("--rule", choices=("schedule", "budget"), default="schedule",
                   help="schedule (default): the smallest r whose two-slot copy schedule predicts no compute wait; "
                        "budget: the smallest r with (N - r) * d <= u * N * c. The config records both.")
    p.add_argument("--copy-utilisation", type=float, default=1.0,
                   help="u in (0, 1]: the share of each block's compute the copies may fill, under either rule "
                        "(default 1; see docs/resident_blocks.md)")
    p.add_argument("--seed", type=int, default=0, help="seed of random weights and activations")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT}/)")
    p.set_defaults(func=run)


def _recipe_defaults(recipe: str) -> tuple[dict[str, Any], bool]:
    """``(defaults, offline)`` of a recipe; a diffusers ``config.json`` has none.

    Raises:
        UnknownRecipeError / RecipeError: not a config.json and not a readable recipe.
    """
    path = Path(recipe)
    if path.suffix == ".json":
        check_input_file(path, "--recipe")
        return {}, False
    from worldfoundry.core.model_loading.recipes import load_recipe

    loaded = load_recipe(recipe)
    return dict(loaded.defaults), bool(loaded.offline)


def check_arguments(args: argparse.Namespace) -> None:
    """Argument mistakes, found before anything is built or measured.

    Raises:
        CommandLineError: unusable ``--device``, ``--out`` that is a file, a missing ``--checkpoint-dir``.
    """
    check_device(args.device)
    check_output_dir(args.out)
    check_input_dir(args.checkpoint_dir, "--checkpoint-dir", "diffusers-format directory")


def _workload(args: argparse.Namespace) -> tuple[Any, Any, tuple[int, int, int], bool]:
    """``(device, dtype, (frames, height, width), offline)`` from the arguments and the recipe's defaults."""
    import torch

    from worldfoundry.core.model_loading.policy import parse_device, parse_dtype

    if not 0.0 < args.copy_utilisation <= 1.0:
        raise ValueError(f"--copy-utilisation must be in (0, 1], got {args.copy_utilisation}")
    device = parse_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here (use --device cpu for the emulated mode)")
    defaults, offline = _recipe_defaults(args.recipe)
    frames = args.frames or defaults.get("num_frames")
    height = args.height or defaults.get("height")
    width = args.width or defaults.get("width")
    if not (frames and height and width):
        raise ValueError(f"--frames, --height and --width are required: recipe {args.recipe!r} has no defaults "
                         "for them")
    return device, parse_dtype(args.dtype), (frames, height, width), offline


def _time_transfer(block: Any, args: argparse.Namespace, device: Any) -> tuple[Any, dict[str, Any]]:
    """The block's host-to-device copy time in the chosen layout, and what the copy was."""
    from worldfoundry.core.offload.host_storage import HostBlockStorage
    from worldfoundry.core.offload.layout import BlockLayout
    from worldfoundry.core.offload.measure import time_block_transfer

    named = list(block.named_parameters())
    storage = HostBlockStorage.from_tensors(BlockLayout.from_tensors(named), [p for _, p in named],
                                            contiguous=args.contiguous, pin=device.type == "cuda", device=device)
    try:
        transfer = time_block_transfer(storage, device=device, warmup=args.warmup, samples=args.samples)
        copy = {"block_bytes": storage.nbytes, "copies_per_block": storage.copies_per_load,
                "pinned": storage.pin_method}
    finally:
        storage.release()
    return transfer, copy


def measure(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """Run the measurement. Returns ``(ResidencyEstimate, paths)``.

    Raises:
        WorldFoundryError: bad recipe, missing weights or an unsupported family.
        ValueError: bad sizes or counts.
    """
    check_arguments(args)
    _recipe_defaults(args.recipe)  # an unknown recipe is named before any size check
    import diffusers
    import torch
    from worldfoundry_resident_blocks.residency_files import write_estimate

    from worldfoundry.base_models.diffusion_model.optimizations.families import family_of
    from worldfoundry.core.model_loading.policy import dtype_name
    from worldfoundry.core.offload.block_probe import build_probe_block, build_probe_inputs, resolve_dit_source
    from worldfoundry.core.offload.estimator import estimate_residency
    from worldfoundry.core.offload.measure import time_block_compute

    device, dtype, (frames, height, width), offline = _workload(args)
    source = resolve_dit_source(args.recipe, args.checkpoint_dir)
    random_weights = args.random_weights or (offline and args.checkpoint_dir is None)
    probe = build_probe_block(source, family_of=functools.partial(family_of, plugin="estimate-residency"),
                              device=device, dtype=dtype, random_weights=random_weights, index=args.block_index,
                              seed=args.seed)
    inputs = build_probe_inputs(probe, frames=frames, height=height, width=width, device=device, dtype=dtype,
                                sequence_length=args.sequence_length, seed=args.seed)
    compute = time_block_compute(probe.block, inputs.make, device=device, warmup=args.warmup, samples=args.samples)
    transfer, copy = _time_transfer(probe.block, args, device)
    emulated = device.type != "cuda"
    context = {
        "recipe": args.recipe, "config_source": source.origin, "model_class": probe.model_class.__name__,
        "family": probe.family, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if not emulated else "cpu (emulated)",
        "emulated": emulated, "dtype": dtype_name(dtype), "weights": probe.weights, "block_path": probe.path,
        "block_bytes": copy["block_bytes"], "frames": frames, "height": height, "width": width,
        "tokens": inputs.tokens, "input_shapes": dict(inputs.shapes), "compute": compute.to_json(),
        "transfer": transfer.to_json(),
        "transfer_gb_per_s": (round(copy["block_bytes"] / (transfer.median_ms * 1e6), 2)
                              if transfer.median_ms > 0 else None),
        "copies_per_block": copy["copies_per_block"], "pinned": copy["pinned"], "warmup": args.warmup,
        "samples": args.samples, "torch": torch.__version__, "diffusers": diffusers.__version__,
        "created_at": datetime.now(timezone.utc).isoformat(),
    }
    estimate = estimate_residency(probe.num_blocks, compute.median_ms, transfer.median_ms,
                                  contiguous=args.contiguous, context=context,
                                  copy_utilisation=args.copy_utilisation, rule=getattr(args, "rule", "schedule"))
    return estimate, write_estimate(estimate, args.out)


def run(args: argparse.Namespace) -> int:
    from worldfoundry.errors import WorldFoundryError

    try:
        estimate, paths = measure(args)
    except (WorldFoundryError, ValueError, OSError) as exc:
        return usage_error("estimate-residency", exc)
    report = estimate.to_report()
    print(f"device {report['device_name']} ({report['device']}), dtype {report['dtype']}, layout {report['layout']}, "
          f"{report['tokens']} tokens")
    print(f"c = {estimate.compute_ms:.3f} ms/block, d = {estimate.transfer_ms:.3f} ms/block, N = {estimate.num_blocks}")
    print(f"r = {estimate.resident} resident blocks {list(estimate.indices)}; {estimate.streamed} streamed "
          f"(rule {estimate.rule}: {report['rule_text']})")
    rules = report["rules"]
    print("rules: " + "; ".join(f"{name} r = {rules[f'{name}_resident']} (predicted copy wait "
                                f"{rules[f'{name}_predicted_copy_wait_ms']:.2f} ms per forward)"
                                for name in ("schedule", "budget")))
    wait = report["two_slot_predicted_copy_wait_ms_per_forward"]
    if wait > 0:
        print(f"two-slot schedule: the compute would wait about {wait:.2f} ms per forward for copies at this r; "
              f"r = {report['two_slot_resident_without_waits']} predicts no wait (see docs/resident_blocks.md)")
    if report.get("emulated"):
        print("emulated mode (CPU): the times are CPU times and say nothing about a GPU")
    print(json.dumps({k: str(v) for k, v in paths.items()}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run ``estimate-residency`` on its own (``python -m worldfoundry.cli.estimate_residency_cmd ...``)."""
    parser = argparse.ArgumentParser(prog="worldfoundry")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["estimate-residency", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
