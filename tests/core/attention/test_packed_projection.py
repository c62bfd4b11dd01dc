"""PackedProjection: the plain callable that serves diffusers' fused branch from the packed storage."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.attention.fused_projection import NOT_BITWISE, outputs_equal
from worldfoundry.core.attention.packed_projection import (
    CHECKS,
    FUSED,
    MISMATCHES,
    ForwardValidation,
    PackedProjection,
)
from worldfoundry.core.attention.packed_storage import PackedLinearParameters
from worldfoundry.errors import InferenceViewError

NAMES = ("to_q", "to_k", "to_v")


def _owner(in_features: int = 16, out: int = 16, bias: bool = True, dtype: torch.dtype = torch.float32,
           seed: int = 0, names: tuple[str, ...] = NAMES) -> nn.Module:
    torch.manual_seed(seed)
    owner = nn.Module()
    for name in names:
        owner.add_module(name, nn.Linear(in_features, out, bias=bias).to(dtype))
    return owner


def _reference(owner: nn.Module, x: torch.Tensor, names: tuple[str, ...] = NAMES) -> list[torch.Tensor]:
    return [getattr(owner, n)(x) for n in names]


def _install(owner: nn.Module, names: tuple[str, ...] = NAMES) -> PackedProjection:
    pack = PackedLinearParameters.pack([getattr(owner, n) for n in names])
    return PackedProjection(owner, names, pack)


def _events(projection: PackedProjection) -> dict[str, int]:
    out: dict[str, int] = {}
    for (_rid, event), n in projection.drain().items():
        out[event] = out.get(event, 0) + n
    return out


@settings(max_examples=25, deadline=None)
@given(in_features=st.integers(1, 40), out=st.integers(1, 24), parts=st.integers(2, 3), rows=st.integers(1, 50),
       bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16),
       transposed=st.booleans())
def test_chunks_always_equal_the_separate_projections(in_features: int, out: int, parts: int, rows: int, bias: bool,
                                                      dtype: torch.dtype, seed: int, transposed: bool) -> None:
    """Invariant: whatever the GEMM does for a geometry, ``chunk`` of the output equals the dense outputs bitwise."""
    names = NAMES[:parts]
    owner = _owner(in_features, out, bias, dtype, seed, names)
    projection = _install(owner, names)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, in_features, generator=g).to(dtype)
    if transposed:  # a non-contiguous input is its own geometry
        x = torch.randn(2, in_features, rows, generator=g).to(dtype).transpose(1, 2)
    with torch.no_grad():
        first = projection(x).chunk(parts, dim=-1)
        second = projection(x).chunk(parts, dim=-1)
        expected = _reference(owner, x, names)
    assert outputs_equal(first, expected) and outputs_equal(second, expected)
    events = _events(projection)
    assert events[CHECKS] == 1
    assert events.get(FUSED, 0) + events.get("dense:" + NOT_BITWISE, 0) == 2


def test_one_gemm_on_the_shared_storage_and_counts_per_request() -> None:
    owner = _owner()
    projection = _install(owner)
    assert not isinstance(projection, nn.Module)
    storage = owner.to_q.weight.untyped_storage().data_ptr()
    assert all(getattr(owner, n).weight.untyped_storage().data_ptr() == storage for n in NAMES)
    x = torch.randn(3, 16)
    with torch.no_grad():
        projection(x)  # verifies
        with request_scope(RequestContext("r1")):
            for _ in range(3):
                projection(x)
        with request_scope(RequestContext("r2")):
            projection(x)
    assert projection.drain() == {("<no-request>", CHECKS): 1, ("<no-request>", FUSED): 1, ("r1", FUSED): 3,
                                  ("r2", FUSED): 1}
    assert projection.drain() == {}
    assert list(projection.verdicts().values()) == [True]
    assert "x[3, 16] w[48, 16]" in next(iter(projection.verdicts()))


def test_a_geometry_where_the_fused_gemm_differs_runs_the_members() -> None:
    owner = _owner(seed=1)
    projection = _install(owner)
    # A packed weight a little off stands for a GEMM that rounds differently for this geometry.
    projection._weight = projection._weight + 1e-3
    x = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(2):
            out = projection(x)
            assert outputs_equal(out.chunk(3, dim=-1), _reference(owner, x))
    assert _events(projection) == {CHECKS: 1, MISMATCHES: 1, "dense:" + NOT_BITWISE: 2}
    assert list(projection.verdicts().values()) == [False]


@pytest.mark.parametrize("change", ["parameter", "data", "module", "hook", "global_hook", "grad"])
def test_stale_members_run_as_the_dense_model_runs_them(change: str) -> None:
    owner = _owner(seed=2)
    projection = _install(owner)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        projection(x)
    projection.drain()
    seen: list[str] = []
    undo = None
    if change == "parameter":
        owner.to_k.weight = nn.Parameter(owner.to_k.weight.detach() * 2)
        reason = "parameter_replaced"
    elif change == "data":
        owner.to_v.bias.data = owner.to_v.bias.data.clone() + 1
        reason = "storage_changed"
    elif change == "module":
        owner.to_q = nn.Linear(16, 16)
        reason = "module_replaced"
    elif change == "hook":
        undo = owner.to_v.register_forward_hook(lambda m, i, o: seen.append("to_v"))
        reason = "projection_hooks"
    elif change == "global_hook":
        undo = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append("global"))
        reason = "global_module_hooks"
    else:
        reason = "weights_require_grad"
    try:
        with torch.set_grad_enabled(change == "grad"):
            out = projection(x)
            expected = _reference(owner, x)
    finally:
        if undo is not None:
            undo.remove()
    assert outputs_equal([t.detach() for t in out.chunk(3, dim=-1)], [t.detach() for t in expected])
    assert _events(projection) == {"dense:" + reason: 1}
    if change in ("hook", "global_hook"):
        assert seen  # the hooks ran, as in the dense model
    if change == "grad":
        out.sum().backward()
        assert owner.to_q.weight.grad is not None


def test_replaced_projections_with_other_sizes_are_refused_loudly() -> None:
    owner = _owner(seed=3)
    projection = _install(owner)
    owner.to_v = nn.Linear(16, 8)
    with pytest.raises(InferenceViewError, match="Uninstall the acceleration first"):
        projection(torch.randn(2, 16))


def test_release_and_construction_errors() -> None:
    owner = _owner(seed=4)
    pack = PackedLinearParameters.pack([owner.to_q, owner.to_k, owner.to_v])
    with pytest.raises(ValueError, match="does not hold"):
        PackedProjection(owner, ("to_k", "to_q", "to_v"), pack)
    projection = PackedProjection(owner, NAMES, pack)
    projection.release()
    x = torch.randn(1, 16)
    with torch.no_grad():
        assert outputs_equal(projection(x).chunk(3, dim=-1), _reference(owner, x))
    assert _events(projection) == {"dense:unpacked": 1}
    unequal = nn.Module()
    unequal.a, unequal.b = nn.Linear(4, 4), nn.Linear(4, 2)
    with pytest.raises(ValueError, match="equal out_features"):
        PackedProjection(unequal, ("a", "b"), PackedLinearParameters.pack([unequal.a, unequal.b]))


def test_cannot_be_copied_or_pickled() -> None:
    projection = _install(_owner())
    with pytest.raises(InferenceViewError, match="Uninstall"):
        copy.deepcopy(projection)
    with pytest.raises(InferenceViewError, match="Uninstall"):
        pickle.dumps(projection)


def test_counts_are_exact_under_threads() -> None:
    owner = _owner(seed=5)
    projection = _install(owner)
    x = torch.randn(2, 16)
    with torch.no_grad():
        projection(x)
    projection.drain()

    def work(rid: str) -> None:
        with torch.no_grad(), request_scope(RequestContext(rid)):
            for _ in range(200):
                projection(x)

    threads = [threading.Thread(target=work, args=(f"r{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    drained: dict[tuple[str, str], int] = {}
    for _ in range(20):  # drains racing with the calls lose nothing
        for key, n in projection.drain().items():
            drained[key] = drained.get(key, 0) + n
    for thread in threads:
        thread.join()
    for key, n in projection.drain().items():
        drained[key] = drained.get(key, 0) + n
    assert drained == {(f"r{i}", FUSED): 200 for i in range(4)}


class _Model(nn.Module):
    """A root module whose forward calls the packed projection of its child, as a diffusers processor would."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.attn = _owner(seed=seed)
        self.projection = _install(self.attn)
        self.validation = ForwardValidation([self.projection])
        self.register_forward_pre_hook(self.validation.pre_hook)
        self.register_forward_hook(self.validation.post_hook, always_call=True)
        self.seen_trusted: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_trusted.append(self.projection._trust.owner == threading.get_ident())
        return self.projection(x)


def test_a_validated_forward_skips_the_checks_and_attributes_its_calls() -> None:
    model = _Model(seed=6)
    x = torch.randn(2, 16)
    with torch.no_grad():
        reference = _reference(model.attn, x)
        with request_scope(RequestContext("r1")):
            for _ in range(3):
                assert outputs_equal(model(x).chunk(3, dim=-1), reference)
    assert model.seen_trusted == [True, True, True]
    assert model.projection._trust.owner is None
    assert model.projection.drain() == {("r1", CHECKS): 1, ("r1", FUSED): 3}
    # a Parameter replaced between forwards: the next forward is not trusted, the call checks and falls back
    model.attn.to_k.weight = nn.Parameter(model.attn.to_k.weight.detach() + 1)
    assert not model.validation.valid()
    with torch.no_grad():
        out = model(x)
        assert outputs_equal(out.chunk(3, dim=-1), _reference(model.attn, x))
    assert model.seen_trusted[-1] is False
    assert _events(model.projection) == {"dense:parameter_replaced": 1}


def test_a_forward_that_raises_releases_the_trust() -> None:
    model = _Model(seed=7)
    with torch.no_grad(), pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # wrong in_features: F.linear raises inside the forward
    assert model.projection._trust.owner is None
    with torch.no_grad():
        model(torch.randn(2, 16))
    assert model.seen_trusted == [True, True]


def test_concurrent_forwards_count_exactly() -> None:
    model = _Model(seed=8)
    x = torch.randn(3, 16)
    with torch.no_grad():
        model(x)
    model.projection.drain()

    def work(rid: str) -> None:
        with torch.no_grad(), request_scope(RequestContext(rid)):
            for _ in range(150):
                model(x)

    threads = [threading.Thread(target=work, args=(f"t{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert model.projection.drain() == {(f"t{i}", FUSED): 150 for i in range(3)}
    assert model.validation._active == 0


def test_a_second_forward_revokes_the_trust_and_both_count_exactly() -> None:
    """Deterministic overlap: forward A pauses between two calls while forward B runs in another thread."""
    model = _Model(seed=9)
    x = torch.randn(2, 16)
    with torch.no_grad():
        model(x)
    model.projection.drain()
    paused, resume = threading.Event(), threading.Event()
    trusted_in_a: list[bool] = []

    class Paused(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            me = threading.get_ident()
            out = model.projection(x)
            trusted_in_a.append(model.projection._trust.owner == me)
            paused.set()
            resume.wait(5)
            out = model.projection(x) + out
            trusted_in_a.append(model.projection._trust.owner == me)
            return out

    wrapper = Paused()
    wrapper.register_forward_pre_hook(model.validation.pre_hook)
    wrapper.register_forward_hook(model.validation.post_hook, always_call=True)

    def run_a() -> None:
        with torch.no_grad(), request_scope(RequestContext("a")):
            wrapper(x)

    thread = threading.Thread(target=run_a)
    thread.start()
    assert paused.wait(5)
    with torch.no_grad(), request_scope(RequestContext("b")):
        model(x)
        model(x)
    resume.set()
    thread.join()
    assert trusted_in_a == [True, False]  # B's forward revoked A's trust
    assert model.seen_trusted[-2:] == [False, False]  # B never got it while A was running
    assert model.projection.drain() == {("a", FUSED): 2, ("b", FUSED): 2}
    with torch.no_grad():
        model(x)
    assert model.seen_trusted[-1] is True  # alone again: trusted
