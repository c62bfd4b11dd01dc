"""Writing ``results.json``, ``report.md`` and the PNG plots of a benchmark run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from worldfoundry.bench.host_gate import describe as describe_gate
from worldfoundry.bench.host_speed import describe as describe_host
from worldfoundry.bench.run_budget import describe as describe_run_budget
from worldfoundry.bench.stats import held_by_floor
from worldfoundry.bench.timing import undecided
from worldfoundry.bench.metrics import json_number



def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        if math.isinf(value):
            return "∞ (identical)" if value > 0 else "-∞"
        return f"{value:.{digits}g}"
    return str(value)


def _jsonify(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonify(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonify(v) for v in value]
    if isinstance(value, float):
        return json_number(value)
    return value


def write_results(results: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / "results.json"
    path.write_text(json.dumps(_jsonify(results), indent=2, allow_nan=False))
    return path


def render_table(results: dict[str, Any]) -> str:
    """The Markdown table a person reads (one row per candidate)."""
    lines = [
        "| candidate | verdict | exact (claimed / bitwise) | latent rel L2 | PSNR dB | min SSIM | speedup | 95% CI | executed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["candidates"]:
        worst = c.get("quality", {}).get("worst", {})
        speed = c.get("speed") or {}
        ci = speed.get("ci95")
        exact = f"{_fmt(c.get('exact_claimed'))} / {_fmt(worst.get('bitwise_equal'))}"
        executed = "yes" if c.get("executed") else ("–" if c["verdict"] == "rejected_at_install" else "**no**")
        lines.append(
            f"| {c['name']} | **{c['verdict']}** | {exact} | {_fmt(worst.get('latent_rel_l2'))} | "
            f"{_fmt(worst.get('psnr_db'))} | {_fmt(worst.get('min_ssim'))} | "
            f"{_fmt(speed.get('speedup'), 4)}{'×' if speed else ''} | "
            f"{'[' + _fmt(ci[0], 4) + ', ' + _fmt(ci[1], 4) + ']' if ci else '–'} | {executed} |"
        )
    return "\n".join(lines)


def _wall_line(results: dict[str, Any]) -> list[str]:
    """Where the run's wall time went (``results["wall_s"]``; absent in results written before it existed)."""
    walls = results.get("wall_s")
    if not isinstance(walls, dict) or "total" not in walls:
        return []
    parts = [f"planning {walls['plan']:.0f} s"] if "plan" in walls else []
    parts += [f"model load {walls.get('load', 0):.0f} s",
             f"dense pilot and control {walls.get('dense_and_control', 0):.0f} s",
             f"{sum('wall_s' in c for c in results.get('candidates', []))} candidates "
             f"{walls.get('candidates', 0):.0f} s"]
    if "peers" in walls:
        parts.append(f"peers {walls['peers']:.0f} s")
    if "retake" in walls:
        parts.append(f"noise floor retake {walls['retake']:.0f} s")
    if "settle" in walls:
        parts.append(f"settling pass {walls['settle']:.0f} s")
    return [f"- wall: {walls['total']:.0f} s ({', '.join(parts)})"]


def write_report(results: dict[str, Any], out_dir: Path) -> Path:
    env = results["environment"]
    git = results["git"]
    lines = [f"# Benchmark: {results['model']}", ""]
    if results.get("noisy_host"):
        lines += [f"> **{results['noisy_host']}**", ""]
    if git.get("dirty"):
        lines += [f"> **DIRTY TREE** — uncommitted changes at revision {git.get('revision')}: "
                  f"{', '.join(git.get('changed', [])[:8])}. Results may not be reproducible.", ""]
    if results.get("random_weights"):
        lines += ["> **Random weights**: speed and bitwise exactness are meaningful; quality numbers of approximate "
                  "candidates are not (a random model has no denoising trajectory to preserve).", ""]
    budget = results["budget"]
    lines += [
        f"- device: {env.get('device')} {env.get('gpu', '')} · torch {env.get('torch')} · triton {env.get('triton')} · "
        f"diffusers {env.get('diffusers')}",
        f"- revision: {git.get('revision')}{' (dirty)' if git.get('dirty') else ''}",
        f"- workload: {json.dumps(results['workload'])}",
        f"- seeds: {results['seeds']} · paired rounds: {results['rounds']} · quality budget: rel L2 ≤ "
        f"{budget['latent_rel_l2']}, PSNR ≥ {budget['psnr_db']} dB, min SSIM ≥ {budget['min_ssim']}",
        f"- GPU sharing during timing: {_sharing(results)}",
        f"- timing: {_timing_line(results)}",
        f"- host speed: {describe_host(results.get('host_speed'))}",
        f"- host gate: {describe_gate(results.get('host_gate'))}",
        f"- run budget: {describe_run_budget(results.get('run_budget'))}",
        *_wall_line(results),
        *_retake_line(results.get("retake")),
        *_settle_line(results.get("settle")),
        f"- dense output unchanged after all candidates: {results['dense'].get('stable_after_candidates')}",
        "",
        render_table(results),
        "",
        *_peer_lines(results),
        "Speedup = dense time / candidate time of the denoising loop over interleaved paired rounds (the "
        "estimator of each row is in results.json: by default the step floor, per-step minima over rounds, with a "
        "paired bootstrap CI). `recommended` needs quality within budget and a CI lower bound above "
        f"{_fmt(results.get('decision_threshold', results.get('noise_floor')), 4)}: the larger of the noise floor "
        f"({_fmt(results.get('noise_floor'), 4)}, the upper CI bound of dense-vs-dense control pairs timed the "
        f"same way, at least 1) and 1 + the minimum gain ({_fmt(results.get('min_gain'), 3)}).",
        "",
    ]
    for c in results["candidates"]:
        lines += _candidate_details(c, results.get("timing_policy") or {}, results)
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _candidate_details(c: dict[str, Any], policy: dict[str, Any] | None = None,
                       results: dict[str, Any] | None = None) -> list[str]:
    """The report's lines under one candidate: errors, what did not run, fallbacks, skips, an unsettled verdict, a
    verdict the noise floor held back, notes (``policy``: the run's ``timing_policy``, for the threshold and the
    verdict margin; ``results``: the run's, for its noise floor and minimum gain)."""
    details = []
    if c.get("error"):
        details.append(f"  - error: {c['error']}")
    missing = c.get("missing", [])
    for item in missing[:10]:
        details.append(f"  - not executed: {item}")
    if len(missing) > 10:
        details.append(f"  - … and {len(missing) - 10} more not executed (all in results.json)")
    if c.get("timing_invalid"):
        details.append(f"  - invalid timing: {c['timing_invalid']}")
    if c.get("fallbacks"):
        details.append(f"  - dense fallbacks: {json.dumps(c['fallbacks'])}")
    if c.get("skipped"):
        details.append(f"  - skipped work: {json.dumps(c['skipped'])}")
    if c.get("timing_mismatch"):
        details.append(f"  - timing mismatches: {c['timing_mismatch'][:3]}")
    details += _dense_floor_note(c.get("speed") or {})
    details += _settle_note(c)
    details += _unsettled_note(c, policy or {})
    details += _floor_held_note(c, results or {})
    if c.get("notes"):
        details.append(f"  - notes: {c['notes']}")
    return [f"- **{c['name']}** ({json.dumps(c['accelerations'])})", *details] if details else []


def _retake_line(retake: dict[str, Any] | None) -> list[str]:
    """The noise floor's retake (:mod:`worldfoundry.bench.retake`), when the run had one."""
    if not retake:
        return []
    before, after = retake["before"], retake["after"]
    line = (f"- noise floor retake: the control pair timed at the start read [{before['ci95'][0]:.3f}, "
            f"{before['ci95'][1]:.3f}] over {before['rounds']} rounds (noise floor {before['noise_floor']:.3f}); ")
    if not retake["rounds_added"]:
        return [line + f"no round added ({retake['stopped']}), so that floor stands"]
    return [line + f"{retake['rounds_added']} rounds added after every row, before the peers ({retake['seconds']:.0f} s, "
            f"stopped: {retake['stopped']}): [{after['ci95'][0]:.3f}, {after['ci95'][1]:.3f}] over "
            f"{after['rounds']} rounds, noise floor {after['noise_floor']:.3f}; every speed verdict decided again "
            f"against it"]


def _settle_line(settle: dict[str, Any] | None) -> list[str]:
    """The run's settling pass (:mod:`worldfoundry.bench.settle`), when there was one to run."""
    if not settle or not (settle.get("candidates") or settle.get("widened") or settle.get("refused")):
        return []
    line = (f"- settling pass: {len(settle['candidates'])} candidate(s) whose verdict had not settled"
            + (f" and {len(settle['widened'])} whose CI was wider than the target" if settle.get("widened") else "")
            + f" timed again after every row, before the peers ({settle['seconds']:.0f} s)")
    if settle.get("refused"):
        line += f"; no time left in the run budget for {', '.join(settle['refused'])}"
    return [line]


def _settle_note(c: dict[str, Any]) -> list[str]:
    """What the settling pass changed for one candidate."""
    done = c.get("settle")
    if not done:
        return []
    before, speed = done["before"], c.get("speed") or {}
    low, high = before["ci95"]
    what = "settling pass (CI wider than the target)" if done.get("reason") == "width" else "settling pass"
    line = (f"  - {what}: {before['speedup']:.3f}× [{low:.3f}, {high:.3f}] after {before['rounds']} rounds "
            f"({before['verdict']}, stopped: {before.get('stopped')})")
    if before.get("error"):
        return [line + f"; the pass failed ({before['error']}), so that result stands"]
    ci = speed.get("ci95") or [float("nan")] * 2
    return [line + f" → {speed.get('speedup', float('nan')):.3f}× [{ci[0]:.3f}, {ci[1]:.3f}] after "
            f"{speed.get('rounds')} rounds ({c.get('verdict')}, stopped: {speed.get('stopped')}) in "
            f"{done['seconds']:.0f} s"]


def _unsettled_note(c: dict[str, Any], policy: dict[str, Any]) -> list[str]:
    """A speed verdict whose CI still straddled the threshold, or cleared it by no more than the verdict margin, when
    the candidate's rounds ended: a repeat run may give the other verdict."""
    speed = c.get("speed") or {}
    threshold, margin = policy.get("threshold"), policy.get("verdict_margin", 0.0)
    if c.get("verdict") not in ("recommended", "no_stable_gain") or not speed.get("ci95") or threshold is None:
        return []
    if not undecided(speed, threshold, margin):
        return []
    low, high = speed["ci95"]
    return [f"  - verdict not settled: CI [{low:.3f}, {high:.3f}] against the threshold {threshold:.3f} (margin "
            f"{margin:.1%}) when its rounds ended ({speed.get('stopped', '?')}, {speed.get('rounds', '?')} rounds); "
            "a repeat run may give the other verdict"]


def _floor_held_note(c: dict[str, Any], results: dict[str, Any]) -> list[str]:
    """A ``no_stable_gain`` that only this run's noise floor withheld (:func:`~worldfoundry.bench.stats.held_by_floor`)."""
    floor, min_gain = results.get("noise_floor"), results.get("min_gain")
    speed = c.get("speed") or {}
    if not held_by_floor(c.get("verdict"), speed, floor, min_gain):
        return []
    low, high = speed["ci95"]
    return [f"  - held back by this run's noise floor: CI [{low:.3f}, {high:.3f}] clears 1 + the minimum gain "
            f"({1 + max(0.0, min_gain or 0.0):.3f}) but not the noise floor ({floor:.3f}) that the dense-vs-dense "
            "control pairs set on this host; on a quieter host the same CI would be `recommended` (run again)"]


def _dense_floor_note(speed: dict[str, Any]) -> list[str]:
    """What the report says of a pair whose dense arm stayed slower than the run's dense floor."""
    source = speed.get("dense_floor_source")
    if source is None:
        return []
    slowed = f"this pair's dense arm stayed {speed['dense_excess']:.0%} above the run's dense floor (host slow phase)"
    share = speed.get("candidate_host_share")
    if source == "pair":
        why = "the candidate was host-bound too" if share is not None else "the candidate's host time was not recorded"
        low = speed["ci95"][0] / (1.0 + speed["dense_excess"])
        return [f"  - {slowed}; {why}{'' if share is None else f' (host busy {share:.0%} of its steps)'}, so its "
                f"own pair's estimate stands, and a gain is called stable only if its CI's lower bound divided by "
                f"1 + that excess ({low:.3f}) clears the threshold"]
    pair = speed["pair_estimate"]
    return [f"  - speedup against the run's dense floor: {slowed}, and the candidate was device-bound (host busy "
            f"{share:.0%} of its steps); against its own dense arm {pair['speedup']:.3f}× "
            f"[{pair['ci95'][0]:.3f}, {pair['ci95'][1]:.3f}]"]


def _sharing(results: dict[str, Any]) -> str:
    if results.get("environment", {}).get("device", "cpu") == "cpu":
        return "not applicable (CPU run)"
    shared = results.get("gpu_sharing", {}).get("shared")
    return "not measured" if shared is None else ("**yes**" if shared else "no")


def _timing_line(results: dict[str, Any]) -> str:
    tp = results.get("timing_policy")
    if not tp or results.get("quality_only"):
        return "none (quality only)"
    return (f"adaptive rounds {tp['min_rounds']}–{tp['max_rounds']} until the CI half-width ≤ "
            f"{tp['target_halfwidth']:.1%} or {tp['budget_s']:.0f} s per candidate; denoise loop timed with "
            f"{'CUDA events' if results.get('environment', {}).get('device') == 'cuda' else 'perf_counter'}; "
            f"noise floor {_fmt(results.get('noise_floor'), 4)} (no speed verdicts above {tp['max_noise_floor']}); "
            f"a candidate whose CI straddles {_fmt(tp.get('threshold'), 4)} or clears it by at most "
            f"{tp.get('verdict_margin', 0):.1%}, or whose dense arm ran slower than the run's dense floor by more "
            f"than the target half-width while its CI reaches the threshold, gets rounds up to "
            f"{tp.get('extend_factor', 1):g}x the budget"
            + (f"; garbage collector {tp['gc']}" if tp.get("gc") else ""))


def _peer_lines(results: dict[str, Any]) -> list[str]:
    peers = results.get("peers")
    if not peers:
        return []
    lines = ["Peer reference rows (not plugins; timed the same way):", "",
             "| peer | status | latent rel L2 | warm-up s | speedup | 95% CI | rounds |", "|---|---|---|---|---|---|---|"]
    for p in peers:
        sp = p.get("speed") or {}
        ci = sp.get("ci95")
        status = p.get("reason") or p.get("error") or p["verdict"]
        if p.get("restore_error"):
            status = f"{status}; **not restored**: {p['restore_error']}"
        lines.append(f"| {p['name']} | {status} | {_fmt(p.get('latent_rel_l2'))} | {_fmt(p.get('warmup_s'), 3)} | "
                     f"{_fmt(sp.get('speedup'))}{'×' if sp else ''} | "
                     f"{'[' + _fmt(ci[0]) + ', ' + _fmt(ci[1]) + ']' if ci else '–'} | {_fmt(sp.get('rounds'))} |")
    return lines + [""]


def write_plots(results: dict[str, Any], out_dir: Path) -> list[Path]:
    """The PNG plots (see :mod:`worldfoundry.bench.plots`)."""
    from worldfoundry.bench.plots import write_all

    return write_all(results, out_dir)

