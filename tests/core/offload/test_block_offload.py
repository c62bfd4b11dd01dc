"""The offload engine on a generic block stack (not a diffusers model): the core is model agnostic."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

from worldfoundry.core.offload.block_offload import BlockOffloadEngine
from worldfoundry.errors import InferenceViewError, ModelBusyError, OffloadScheduleError


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin(self.norm(x))


class Stack(nn.Module):
    def __init__(self, n: int = 5, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n))
        self.order: list[int] | None = None

    def forward(self, x: torch.Tensor, engine: BlockOffloadEngine | None = None) -> torch.Tensor:
        for i in (self.order or range(len(self.blocks))):
            block = self.blocks[i]
            x = engine.run_block(i, lambda b=block, x=x: b(x)) if engine is not None else block(x)
        return x


def _engine(model: Stack, resident=(), contiguous=False) -> BlockOffloadEngine:
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    engine = BlockOffloadEngine(blocks, resident, contiguous=contiguous, device=torch.device("cpu"))
    engine.offload()
    return engine


def _forward(model: Stack, engine: BlockOffloadEngine, x: torch.Tensor):
    engine.begin_forward()
    try:
        out = model(x, engine)
    except BaseException:
        engine.end_forward(failed=True)
        raise
    return out, engine.end_forward()


X = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("resident", [(), (1, 3), (0, 1, 2, 3, 4)])
def test_exact_and_restored(resident) -> None:
    model = Stack()
    with torch.no_grad():
        reference = model(X)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    engine = _engine(model, resident, contiguous=True)
    engine.begin_request("r")
    with torch.no_grad():
        for _ in range(3):
            out, outcome = _forward(model, engine, X)
            assert torch.equal(out, reference)
            assert outcome.transfers.transfers == 5 - len(resident)
    receipt = engine.end_request("r")
    assert receipt.transfers_per_forward == (5 - len(resident),) * 3
    assert receipt.resident_builds == (1 if resident else 0)
    engine.restore()
    assert [id(p) for p in model.parameters()] == params
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k])


def test_plan_follows_the_actual_execution_order() -> None:
    model = Stack()
    model.order = [4, 3, 2, 1, 0]
    with torch.no_grad():
        reference = model(X)
    engine = _engine(model)
    engine.begin_request("r")
    with torch.no_grad():
        out, first = _forward(model, engine, X)
        assert torch.equal(out, reference)
        assert first.transfers.misses > 0  # the first plan was the index order
        out, second = _forward(model, engine, X)
        assert torch.equal(out, reference)
    assert second.transfers.misses == 0 and second.transfers.discarded == 0
    assert second.transfers.transfer_log == [(4, 0), (3, 1), (2, 0), (1, 1), (0, 0)]
    engine.end_request("r")
    engine.restore()


def test_requests_are_exclusive_and_forwards_single_threaded() -> None:
    model = Stack()
    engine = _engine(model, (2,))
    engine.begin_request("a")
    with pytest.raises(ModelBusyError, match="'a'"):
        engine.begin_request("b")
    engine.begin_forward()
    errors = []
    thread = threading.Thread(target=lambda: _capture(errors, engine.begin_forward))
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], ModelBusyError)
    engine.end_forward()
    engine.end_request("a")
    with pytest.raises(OffloadScheduleError, match="outside a forward"):
        engine.run_block(0, lambda: None)
    engine.restore()


def _capture(errors: list, fn) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - collected for the assertion
        errors.append(exc)


def test_a_forward_that_never_ended_is_recovered() -> None:
    """A KeyboardInterrupt skips the model's always-called hooks; the next forward of the thread recovers."""
    model = Stack()
    with torch.no_grad():
        reference = model(X)
    engine = _engine(model, (0,))
    engine.begin_request("r")
    engine.begin_forward()
    with pytest.raises(KeyboardInterrupt):
        engine.run_block(1, lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert all(p.data_ptr() == m.data_ptr()
               for p, m in zip(model.blocks[1].parameters(), engine._blocks[1].storage.masters))
    with torch.no_grad():
        out, _ = _forward(model, engine, X)  # begin_forward finds the stale forward and ends it as failed
    assert torch.equal(out, reference)
    receipt = engine.end_request("r")
    assert receipt.failed_forwards == 1 and receipt.forwards == 2 and receipt.resident_builds == 2
    engine.restore()


def test_end_request_ends_a_dangling_forward_and_restore_ends_the_request() -> None:
    model = Stack()
    engine = _engine(model, (0,))
    engine.begin_request("r")
    engine.begin_forward()
    receipt = engine.end_request("r")
    assert receipt.failed_forwards == 1
    engine.begin_request("r2")
    engine.restore()  # uninstall with an active request releases it first
    assert engine.device_bytes()["total"] == 0
    with torch.no_grad():
        assert torch.equal(model(X), Stack()(X))


def test_replaced_weights_are_detected() -> None:
    model = Stack()
    engine = _engine(model)
    model.blocks[2].lin.weight.data = model.blocks[2].lin.weight.data.clone()
    with pytest.raises(InferenceViewError, match="blocks.2.lin.weight"):
        engine.begin_forward()
    assert not engine.in_forward
    engine.restore()


def test_offload_failure_restores_what_moved() -> None:
    model = Stack()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.blocks[3].lin.bias = nn.Parameter(torch.empty(8, device="meta"))
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]
    engine = BlockOffloadEngine(blocks, (), contiguous=False, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="blocks.3.lin.bias is on meta"):
        engine.offload()
    for k, v in model.state_dict().items():
        if k != "blocks.3.lin.bias":
            assert v.device.type == "cpu" and torch.equal(v, state[k])


def test_bad_indices() -> None:
    blocks = [(f"blocks.{i}", b) for i, b in enumerate(Stack().blocks)]
    with pytest.raises(ValueError, match="distinct"):
        BlockOffloadEngine(blocks, (1, 1), contiguous=False, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="distinct"):
        BlockOffloadEngine(blocks, (5,), contiguous=False, device=torch.device("cpu"))
