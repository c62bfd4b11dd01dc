"""Receipts are data: bounded, JSON-serialisable, keyed by request, never holding tensors."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from worldfoundry.core.acceleration.context import NO_REQUEST, RequestContext, current_request, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.receipts import (
    DEFAULT_MAX_KEYS,
    MAX_REASON_CHARS,
    OVERFLOW_KEY,
    ExecutionLedger,
    InstallReceipt,
    PluginInstallRecord,
    empty_request_report,
    jsonable,
)
from worldfoundry.core.acceleration.session import runtime_optimization_report


def test_only_the_last_requests_are_kept_and_totals_cover_all():
    ledger = ExecutionLedger("p", max_requests=4)
    for i in range(50):
        with request_scope(RequestContext(f"r{i}")):
            ledger.executed("blocks.0", "kernel")
            ledger.skipped("steps", 2)
    report = ledger.report()
    assert list(report["requests"]) == ["r46", "r47", "r48", "r49"]
    assert report["dropped_requests"] == 46
    assert report["totals"] == {"kernel": 50, "skipped_steps": 100}
    assert report["requests"]["r49"]["skipped"] == {"steps": 2}
    json.dumps(report)


def test_records_are_keyed_by_the_current_request():
    ledger = ExecutionLedger("p")
    assert current_request() is None
    ledger.count("calls")
    with request_scope(RequestContext("a", branch="cond", step_index=0)):
        assert current_request().branch == "cond"
        ledger.executed("m", "fused")
        with request_scope(RequestContext("b")):
            ledger.fallback("m", "too small")
        ledger.executed("m", "fused", request_id="explicit")
    assert current_request() is None
    report = ledger.report()["requests"]
    assert report[NO_REQUEST]["counters"] == {"calls": 1}
    assert report["a"]["modules"] == {"m": {"fused": 1}}
    assert report["b"]["fallbacks"] == {"too small": 1} and report["b"]["module_fallbacks"] == {"m": {"too small": 1}}
    assert report["explicit"]["counters"] == {"fused": 1}
    assert ledger.request_report("missing") is None
    ledger.finish("a")
    assert ledger.request_report("a")["finished"] is True
    assert set(empty_request_report()) == set(report["a"])


def test_keys_reasons_and_traces_are_bounded():
    ledger = ExecutionLedger("p", max_trace=5)
    for i in range(DEFAULT_MAX_KEYS + 50):
        ledger.fallback("m", f"reason {i}", request_id="r")
        ledger.count(f"counter_{i}", request_id="r")
        ledger.note(f"note_{i}", i, request_id="r")
        ledger.trace(f"trace_{i}", i, request_id="r")
    for i in range(20):
        ledger.trace("trace_0", i, request_id="r")
    ledger.fallback("m", "x" * 10_000, request_id="long")
    r = ledger.request_report("r")
    assert len(r["fallbacks"]) == DEFAULT_MAX_KEYS + 1 and r["fallbacks"][OVERFLOW_KEY] == 50
    assert r["counters"]["dense_fallback"] == DEFAULT_MAX_KEYS + 50
    assert len(r["counters"]) == DEFAULT_MAX_KEYS + 1 and OVERFLOW_KEY in r["counters"]
    assert len(r["notes"]) == DEFAULT_MAX_KEYS and len(r["traces"]) == DEFAULT_MAX_KEYS
    assert len(r["traces"]["trace_0"]) == 5
    assert len(next(iter(ledger.request_report("long")["fallbacks"]))) == MAX_REASON_CHARS
    assert len(json.dumps(ledger.report())) < 200_000


def test_tensors_are_never_kept():
    ledger = ExecutionLedger("p")
    big = torch.randn(64, 64)
    ledger.note("norm", torch.tensor(2.5), request_id="r")
    ledger.note("big", big, request_id="r")
    ledger.trace("values", torch.tensor([7]), request_id="r")
    notes = ledger.request_report("r")["notes"]
    assert notes["norm"] == 2.5 and notes["big"] == "<tensor shape=[64, 64] dtype=torch.float32>"
    assert ledger.request_report("r")["traces"]["values"] == [7]
    assert jsonable({1: {"b", "a"}, "t": (torch.float16, None)}) == {"1": ["a", "b"], "t": ["torch.float16", None]}


def test_ledger_is_thread_safe():
    ledger = ExecutionLedger("p")

    def work() -> None:
        for _ in range(500):
            ledger.executed("m", "kernel", request_id="shared")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ledger.report()["totals"] == {"kernel": 4000}
    assert ledger.request_report("shared")["modules"] == {"m": {"kernel": 4000}}


def test_install_receipt_never_claims_execution():
    record = PluginInstallRecord("p", {"k": (1, 2)}, ("blocks.0",), "dist", "1.0", True, ("model",))
    receipt = InstallReceipt((record,), "WanTransformer3DModel", ("model",))
    data = receipt.to_json()
    assert data["execution_verified"] is False and data["exact"] is True
    assert data["plugins"][0]["options"] == {"k": [1, 2]}
    json.dumps(data)
    approx = InstallReceipt((record, PluginInstallRecord("q", {}, (), None, None, None, ("model",))), "M", ("model",))
    assert approx.exact is False and approx.names == ("p", "q")


def test_session_reports_stay_bounded_over_many_requests(tiny_wan, toy_kit, run_wan):
    guard = attach_request_guard(tiny_wan)
    toy_kit.add("p0", "proj_out")
    session = install_diffusion_accelerations(tiny_wan, {"p0": True}, registry=toy_kit.registry)
    ledger = session.handles("p0")["model"].ledger
    for i in range(40):
        with guard.request(f"req{i}"), request_scope(RequestContext(f"req{i}")):
            ledger.executed("proj_out", "toy")  # stands in for a forward (one real one below)
    with guard.request("last"), request_scope(RequestContext("last")):
        run_wan(tiny_wan)
    report = runtime_optimization_report(tiny_wan)
    text = json.dumps(report)
    plugin = report["plugins"]["p0"]["model"]
    assert len(plugin["requests"]) == ledger.max_requests
    assert plugin["dropped_requests"] == 41 - ledger.max_requests
    assert plugin["totals"] == {"toy": 41}
    assert plugin["requests"]["last"]["finished"] is True
    assert len(text) < 50_000
    session.uninstall()
    assert json.loads(json.dumps(session.execution_report()))["installed"] is False


@pytest.mark.parametrize("bad", [object(), {1, 2}, b"bytes"])
def test_jsonable_accepts_anything(bad):
    json.dumps(jsonable({"value": bad}))
