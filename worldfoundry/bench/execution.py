"""Execution proof: from one request's receipts, did every configured plugin and claimed module really run?

Rules: each plugin (per expert) must have a record for the request; every claimed module path must show an
``executed`` count; plugins holding ``role:quantization`` must show no dense fallback; plugins holding
``role:feature_cache`` must report what they skipped. Anything missing is listed by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from worldfoundry.core.acceleration.prepared import ROLE_FEATURE_CACHE, ROLE_QUANTIZATION, is_role
from worldfoundry.core.acceleration.session import SINGLE_MODEL_LABEL


def _split_claim(claim: str, experts: list[str]) -> tuple[str, str]:
    if len(experts) == 1 and experts[0] == SINGLE_MODEL_LABEL:
        return SINGLE_MODEL_LABEL, claim
    expert, _, module = claim.partition("/")
    return expert, module


def prove_execution(installed: Mapping[str, Any] | None, plugins: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Check one request's receipts (``DiffusionResult.receipts``) against the install receipt."""
    missing: list[str] = []
    fallbacks: dict[str, dict[str, int]] = {}
    skipped: dict[str, dict[str, int]] = {}
    executed_modules: dict[str, int] = {}
    if not installed:
        return {"executed": False, "missing": ["no install receipt"], "fallbacks": {}, "skipped": {}}
    for plugin in installed.get("plugins", []):
        name = plugin["name"]
        experts = list(plugin.get("experts") or [SINGLE_MODEL_LABEL])
        claims = list(plugin.get("claims", []))
        roles = {c.split("/", 1)[-1] for c in claims if is_role(c.split("/", 1)[-1])}
        per_expert = plugins.get(name) or {}
        records = {e: per_expert.get(e) for e in experts}
        for expert, record in records.items():
            if not record:
                missing.append(f"{name} ({expert}): no execution record for this request")
        count = 0
        for claim in claims:
            expert, module = _split_claim(claim, experts)
            if is_role(module):
                continue
            record = records.get(expert) or {}
            counts = (record.get("modules") or {}).get(module) or {}
            if sum(int(v) for v in counts.values()) <= 0:
                missing.append(f"{name} ({expert}): claimed module {module!r} never executed")
            else:
                count += 1
        executed_modules[name] = count
        plugin_fallbacks: dict[str, int] = {}
        plugin_skipped: dict[str, int] = {}
        for record in records.values():
            for reason, n in ((record or {}).get("fallbacks") or {}).items():
                plugin_fallbacks[reason] = plugin_fallbacks.get(reason, 0) + int(n)
            for what, n in ((record or {}).get("skipped") or {}).items():
                plugin_skipped[what] = plugin_skipped.get(what, 0) + int(n)
        if plugin_fallbacks:
            fallbacks[name] = plugin_fallbacks
        if ROLE_QUANTIZATION in roles and plugin_fallbacks:
            missing.append(f"{name}: quantized path fell back to dense ({plugin_fallbacks})")
        if ROLE_FEATURE_CACHE in roles:
            skipped[name] = plugin_skipped
            if not any("skipped" in (r or {}) for r in records.values()):
                missing.append(f"{name}: cache plugin reported nothing about skipped work")
    return {"executed": not missing, "missing": missing, "fallbacks": fallbacks, "skipped": skipped,
            "executed_modules": executed_modules}
