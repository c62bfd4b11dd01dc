"""The graph runner on a toy module with the CPU replay executor: signatures, LRU, invalidation, aliasing,
output ownership, eager reasons and the ledger diversion it relies on."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.cuda_graph import (
    NO_CUDA_DEVICE,
    CudaGraphBackend,
    EagerReplayBackend,
    GraphRunner,
    ModelStateWatch,
    call_signature,
)
from worldfoundry.core.acceleration.cuda_graph.signature import StaticArguments, allocate_like
from worldfoundry.core.acceleration.receipts import ExecutionLedger


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("offset", torch.ones(8))

    def forward(self, x: torch.Tensor, scale: float = 1.0, extra: dict | None = None) -> tuple[torch.Tensor]:
        return (self.lin(x) * scale + self.offset,)


def _runner(model: nn.Module, **kw) -> tuple[GraphRunner, ExecutionLedger]:
    ledger = ExecutionLedger("graph")
    return GraphRunner(model, "graph", ledger, EagerReplayBackend(), **kw), ledger


def _call(runner: GraphRunner, model: nn.Module, *args, **kwargs):
    with torch.no_grad():
        return runner(model.forward, args, kwargs)


def _eager(model: nn.Module, *args, **kwargs):
    with torch.no_grad():
        return model(*args, **kwargs)


def test_capture_then_replay_is_exact_and_counted() -> None:
    model = Toy().eval()
    runner, ledger = _runner(model)
    xs = [torch.randn(2, 8) for _ in range(4)]
    with request_scope(RequestContext("r1")):
        outs = [_call(runner, model, x)[0] for x in xs]
    for x, out in zip(xs, outs, strict=True):
        assert torch.equal(out, _eager(model, x)[0])
    record = ledger.request_report("r1")
    assert record["modules"]["<root>"] == {"capture": 1, "replay": 3}
    assert runner.totals["captures"] == 1 and runner.totals["replays"] == 3
    assert runner.report()["signatures"][0]["replays"] == 3


def test_signature_keys_shape_dtype_strides_alignment_and_scalars() -> None:
    x = torch.randn(8, 8)
    base = call_signature((x,), {"scale": 1.0}).key
    assert call_signature((torch.randn(8, 8),), {"scale": 1.0}).key == base  # values do not matter
    assert call_signature((x,), {"scale": 2.0}).key != base
    assert call_signature((torch.randn(4, 8),), {"scale": 1.0}).key != base
    assert call_signature((x.double(),), {"scale": 1.0}).key != base
    assert call_signature((x.t().contiguous().t(),), {"scale": 1.0}).key != base
    shifted = torch.randn(65)[1:].view(8, 8)
    assert call_signature((shifted,), {"scale": 1.0}).key != base  # another pointer alignment
    steps = torch.arange(10.0)  # a small tensor at a new offset every step keeps its signature
    assert call_signature((steps[3:4],), {}).key == call_signature((steps[4:5],), {}).key
    with torch.no_grad():
        assert call_signature((x,), {"scale": 1.0}).key != base  # autograd state is part of it


def test_static_buffers_reproduce_strides_and_alignment() -> None:
    shifted = torch.randn(257)[1:].view(16, 16)[:, ::2]
    sig = call_signature((shifted,), {})
    static = StaticArguments((shifted,), {}, sig)
    buffer = static.buffers[0]
    assert buffer.stride() == shifted.stride() and buffer.shape == shifted.shape
    assert buffer.data_ptr() % 64 == shifted.data_ptr() % 64
    static.load(sig.tensors)
    assert torch.equal(buffer, shifted)
    expanded = torch.randn(1, 8).expand(3, 8)
    out = allocate_like(call_signature((expanded,), {}).specs[0])
    assert out.stride() == expanded.stride()


def test_unkeyable_argument_and_overlap_run_eagerly_with_reason() -> None:
    model = Toy().eval()
    runner, ledger = _runner(model)
    x = torch.randn(2, 8)
    with request_scope(RequestContext("r1")):
        _call(runner, model, x, extra={"k": object()})
        overlapping = torch.randn(16).as_strided((2, 8), (1, 1))
        _call(runner, model, overlapping)
    reasons = ledger.request_report("r1")["fallbacks"]
    assert any("cannot be part of a graph signature" in r for r in reasons)
    assert any("overlapping memory" in r for r in reasons)
    assert runner.totals["captures"] == 0


def test_autograd_enabled_runs_eagerly() -> None:
    model = Toy().eval()
    runner, ledger = _runner(model)
    with request_scope(RequestContext("r1")):
        runner(model.forward, (torch.randn(2, 8),), {})
    assert list(ledger.request_report("r1")["fallbacks"]) == [
        "autograd is enabled; call the model under torch.no_grad() or torch.inference_mode()"]


def test_cuda_backend_without_cuda_reports_no_cuda_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    model = Toy().eval()
    ledger = ExecutionLedger("graph")
    runner = GraphRunner(model, "graph", ledger, CudaGraphBackend())
    x = torch.randn(2, 8)
    with request_scope(RequestContext("r1")):
        assert torch.equal(_call(runner, model, x)[0], _eager(model, x)[0])
    assert ledger.request_report("r1")["fallbacks"] == {NO_CUDA_DEVICE: 1}


def test_lru_evicts_least_recently_used_and_reports_pool_bytes() -> None:
    model = Toy().eval()
    runner, ledger = _runner(model, max_signatures=2)
    a, b, c = torch.randn(1, 8), torch.randn(2, 8), torch.randn(3, 8)
    for x in (a, b, a, c, a, b):
        assert torch.equal(_call(runner, model, x)[0], _eager(model, x)[0])
    # a, b captured; a replayed; c evicts b; a replayed; b evicts c
    assert runner.totals["captures"] == 4 and runner.totals["evictions"] == 2 and runner.totals["replays"] == 2
    report = runner.report()
    assert len(report["signatures"]) == 2
    assert report["pool_bytes"] == sum(s["pool_bytes"] for s in report["signatures"]) > 0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=12), st.integers(1, 3))
def test_lru_property_matches_a_reference_lru(rows: list[int], limit: int) -> None:
    model = Toy().eval()
    runner, _ = _runner(model, max_signatures=limit)
    cache: list[int] = []
    captures = 0
    for n in rows:
        x = torch.randn(n, 8)
        assert torch.equal(_call(runner, model, x)[0], _eager(model, x)[0])
        if n in cache:
            cache.remove(n)
        else:
            captures += 1
            if len(cache) >= limit:
                cache.pop(0)
        cache.append(n)
    assert runner.totals["captures"] == captures
    assert runner.totals["replays"] == len(rows) - captures


@pytest.mark.parametrize("change", ["inplace", "replace", "buffer", "hook", "forward"])
def test_any_model_change_invalidates(change: str) -> None:
    model = Toy().eval()
    runner, ledger = _runner(model)
    x = torch.randn(2, 8)
    _call(runner, model, x)
    _call(runner, model, x)
    with torch.no_grad():
        if change == "inplace":
            model.lin.weight.add_(1.0)
        elif change == "replace":
            model.lin.weight = nn.Parameter(model.lin.weight.detach() * 2)
        elif change == "buffer":
            model.offset.mul_(3.0)
        elif change == "hook":
            model.lin.register_forward_hook(lambda m, i, o: o * 0.5)
        else:
            original = model.lin.forward
            model.lin.forward = lambda t: original(t) + 1.0
    out = _call(runner, model, x)[0]
    assert torch.equal(out, _eager(model, x)[0])
    assert runner.totals["invalidations"] == 1 and runner.totals["captures"] == 2
    assert runner.invalidations[-1]


def test_copy_out_is_owned_by_the_caller_and_static_is_shared() -> None:
    model = Toy().eval()
    runner, _ = _runner(model)
    x = torch.randn(2, 8)
    _call(runner, model, x)
    first = _call(runner, model, x)[0]
    kept = first.clone()
    second = _call(runner, model, torch.randn(2, 8))[0]
    assert first.data_ptr() != second.data_ptr() and torch.equal(first, kept)
    static_runner, _ = _runner(model, output="static")
    _call(static_runner, model, x)
    one = _call(static_runner, model, x)[0]
    two = _call(static_runner, model, x)[0]
    assert one.data_ptr() == two.data_ptr()


def test_aliased_inputs_and_outputs_fed_back() -> None:
    model = Toy().eval()
    runner, _ = _runner(model, output="static")
    x = torch.randn(2, 8)
    expected = x.clone()
    for _ in range(4):  # each output fed back as the next input, the static output buffer aliasing the input
        x = _call(runner, model, x)[0]
        expected = _eager(model, expected)[0]
        assert torch.equal(x, expected)
    y = torch.randn(2, 8)
    assert torch.equal(_call(runner, model, y, extra={"same": y})[0], _eager(model, y)[0])


def test_concurrent_forward_runs_eagerly() -> None:
    model = Toy().eval()
    runner, ledger = _runner(model)
    inner: list[torch.Tensor] = []
    x = torch.randn(2, 8)

    def reentrant(t: torch.Tensor) -> tuple[torch.Tensor]:
        if not inner:
            inner.append(runner(model.forward, (t,), {})[0])
        return model.forward(t)

    with torch.no_grad(), request_scope(RequestContext("r1")):
        runner(reentrant, (x,), {})
    assert "another forward is running on this model" in ledger.request_report("r1")["fallbacks"]


def test_release_frees_everything() -> None:
    model = Toy().eval()
    runner, _ = _runner(model)
    _call(runner, model, torch.randn(2, 8))
    runner.release()
    assert runner.report()["signatures"] == [] and runner.pool_bytes() == 0


def test_watch_is_quiet_without_changes() -> None:
    model = Toy().eval()
    watch = ModelStateWatch(model)
    assert watch.check() == 0 and watch.check() == 0
    model.train()
    assert watch.check() == 1


def test_ledger_divert_keeps_calls_and_apply_rewrites_the_request() -> None:
    ledger = ExecutionLedger("p")
    with request_scope(RequestContext("r1")):
        with ledger.divert() as kept:
            ledger.executed("m", "fused")
            ledger.count("hits", 2, request_id="r1")
        assert ledger.request_report("r1") is None
    with request_scope(RequestContext("r2")):
        ledger.apply(kept, replace_request="r1")
        ledger.apply(kept, replace_request="r1")
    record = ledger.request_report("r2")
    assert record["modules"] == {"m": {"fused": 2}} and record["counters"]["hits"] == 4
    with ledger.divert(), pytest.raises(RuntimeError):
        with ledger.divert():
            pass
