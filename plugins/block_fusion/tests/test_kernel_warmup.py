"""``kernel_compile``: the kernels compile before the first fused call (``blocking``) or beside the original
forwards (``background``), with the same bits either way, visible fallbacks meanwhile, and ``cuda_graph`` never
capturing the original forwards in place of the fused ones.

The compilation is replaced by a gate the test opens (where the kernels compile in this process -- CUDA -- and
where they do not -- Triton's interpreter -- alike), so what runs while it is pending is deterministic.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.cuda_graph import EagerReplayBackend
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.fusion.compile_pool import default_compile_mode, set_default_compile_mode
from worldfoundry_block_fusion import kernel_warmup
from worldfoundry_block_fusion.kernel_warmup import REASON_COMPILING, KernelWarmup

JOBS = [(object(), (1, 2))]


class Gate:
    """A compile function that records its jobs and returns once the test opens it (or raises, ``fail``)."""

    def __init__(self, *, fail: bool = False, opened: bool = False) -> None:
        self.open = threading.Event()
        if opened:
            self.open.set()
        self.fail = fail
        self.calls: list[list[Any]] = []

    def __call__(self, jobs: list[Any]) -> None:
        self.calls.append(list(jobs))
        assert self.open.wait(30)
        if self.fail:
            raise RuntimeError("the compiler broke")


@pytest.fixture
def compiles_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_warmup, "kernels_compile_here", lambda: True)


@pytest.mark.usefixtures("compiles_here")
def test_blocking_compiles_before_returning() -> None:
    gate = Gate(opened=True)
    warmup = KernelWarmup("blocking", gate)
    warmup.start(JOBS)
    assert gate.calls == [JOBS] and not warmup.pending() and warmup.wait(0)
    assert warmup.generation == 0  # a blocking compilation never changes a graph's signature
    assert warmup.report()["kernel_compile"] == "blocking" and warmup.report()["compile_seconds"] is not None


@pytest.mark.usefixtures("compiles_here")
def test_background_compiles_beside_the_caller_and_says_when_it_is_done() -> None:
    gate = Gate()
    warmup = KernelWarmup("background", gate)
    assert warmup.awaiting_first() and not warmup.pending()
    before = warmup.graph_key()
    warmup.start(JOBS)
    assert warmup.pending() and not warmup.awaiting_first()
    assert not warmup.wait(0.01) and warmup.report()["kernels_pending"] is True
    gate.open.set()
    assert warmup.wait(30) and not warmup.pending()
    assert warmup.generation == 1 and warmup.graph_key() != before
    assert gate.calls == [JOBS]


@pytest.mark.usefixtures("compiles_here")
def test_a_failed_background_compilation_is_logged_and_leaves_the_kernels_to_first_use(
        caplog: pytest.LogCaptureFixture) -> None:
    gate = Gate(fail=True, opened=True)
    warmup = KernelWarmup("background", gate)
    with caplog.at_level("WARNING", logger=kernel_warmup.__name__):
        warmup.start(JOBS)
        assert warmup.wait(30)
    assert warmup.generation == 0 and not warmup.pending()
    assert any("compile on first use" in r.getMessage() for r in caplog.records)


@pytest.mark.usefixtures("compiles_here")
def test_a_forked_child_has_no_pending_compilation() -> None:
    gate = Gate()
    warmup = KernelWarmup("background", gate)
    warmup.start(JOBS)
    assert warmup.pending()
    if hasattr(os, "fork"):  # the real thing: the child sees no pending compilation, the parent still does
        pid = os.fork()
        if pid == 0:
            os._exit(0 if not warmup.pending() else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0 and warmup.pending()
    kernel_warmup._after_fork()  # what a forked child runs: the parent's compile thread does not exist there
    assert not warmup.pending() and warmup.wait(0)
    gate.open.set()


def test_nothing_starts_without_jobs_or_where_nothing_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = Gate(opened=True)
    warmup = KernelWarmup("background", gate)
    monkeypatch.setattr(kernel_warmup, "kernels_compile_here", lambda: False)
    warmup.start(JOBS)
    assert not warmup.awaiting_first()  # nothing will compile: nothing to wait for
    monkeypatch.setattr(kernel_warmup, "kernels_compile_here", lambda: True)
    warmup.start([])
    assert gate.calls == [] and not warmup.pending() and not warmup.started


def test_auto_follows_the_process_default_and_bad_modes_are_refused() -> None:
    warmup = KernelWarmup()
    previous = set_default_compile_mode("background")
    try:
        assert warmup.resolved_mode() == "background"
        set_default_compile_mode("blocking")
        assert warmup.resolved_mode() == default_compile_mode() == "blocking"
    finally:
        set_default_compile_mode(previous)
    with pytest.raises(ValueError, match="kernel_compile"):
        KernelWarmup("lazy")
    with pytest.raises(ValueError, match="compile mode"):
        set_default_compile_mode("lazy")


def _request(model: torch.nn.Module, inputs: dict[str, Any], rid: str) -> torch.Tensor:
    with request_scope(RequestContext(rid)), torch.no_grad():
        return model(**inputs)[0]


@pytest.mark.usefixtures("kernels", "compiles_here")
@pytest.mark.parametrize("family", ["wan", "sana"])
def test_background_blocks_run_their_original_forward_until_the_kernels_are_ready(kit: Any, family: str) -> None:
    name = "wan_block_fusion" if family == "wan" else "sana_block_fusion"
    model = kit.build_wan() if family == "wan" else kit.build_sana()
    inputs = kit.wan_inputs() if family == "wan" else kit.sana_inputs()
    reference = _request(model, inputs, "eager")
    session = install_diffusion_accelerations(model, {name: {"kernel_compile": "background"}},
                                              registry=kit.make_registry())
    handle = session.handles(name)["model"]
    gate = Gate()
    handle.kernels.compile_fn = gate
    assert handle.graph_call().eager_reason == REASON_COMPILING  # before the first block: nothing to capture yet
    early = _request(model, inputs, "early")
    assert torch.equal(early, reference)
    report = session.execution_report()["plugins"][name]["model"]
    early_record = report["requests"]["early"]
    # nothing fused: every block ran its original forward (counted by the ledger as dense fallbacks)
    assert early_record["counters"] == {"dense_fallback": len(handle.blocks)}
    assert early_record["fallbacks"] == {REASON_COMPILING: len(handle.blocks)}
    assert report["kernel_compile"] == "background" and report["kernels_pending"] is True
    assert not session.wait_ready(0.01)
    assert handle.graph_call().eager_reason == REASON_COMPILING
    gate.open.set()
    assert session.wait_ready(30)
    call = handle.graph_call()
    assert call.eager_reason is None and call.key == ("kernel_compile", 1)
    late = _request(model, inputs, "late")
    assert torch.equal(late, reference)
    late_record = session.execution_report()["plugins"][name]["model"]["requests"]["late"]
    assert late_record["counters"].get("gated_residual", 0) > 0
    assert REASON_COMPILING not in late_record["fallbacks"]
    session.uninstall()


@pytest.mark.usefixtures("kernels", "compiles_here")
def test_cuda_graph_runs_eagerly_while_the_kernels_compile_and_captures_the_fused_forward(kit: Any) -> None:
    from worldfoundry_cuda_graph.plugin import make_prepare

    model = kit.build_wan()
    inputs = kit.wan_inputs()
    reference = _request(model, inputs, "eager")
    reg = kit.make_registry()
    reg.register("cuda_graph", make_prepare(EagerReplayBackend))
    session = install_diffusion_accelerations(
        model, {"wan_block_fusion": {"kernel_compile": "background"}, "cuda_graph": True}, registry=reg)
    gate = Gate()
    session.handles("wan_block_fusion")["model"].kernels.compile_fn = gate
    outs = [_request(model, inputs, f"pending{i}") for i in range(2)]
    gate.open.set()
    assert session.wait_ready(30)
    outs += [_request(model, inputs, f"ready{i}") for i in range(2)]
    assert all(torch.equal(o, reference) for o in outs)
    report = session.execution_report()["plugins"]
    graph = report["cuda_graph"]["model"]
    assert graph["graphs"]["totals"]["captures"] == 1  # only the fused forward was captured
    assert graph["requests"]["pending0"]["fallbacks"] == {f"wan_block_fusion: {REASON_COMPILING}": 1}
    assert graph["requests"]["ready1"]["modules"]["<root>"] == {"replay": 1}
    assert report["wan_block_fusion"]["model"]["requests"]["ready1"]["counters"]["gated_residual"] > 0
    session.uninstall()
