"""The direct launch path on CUDA: taken, bitwise equal to the normal path and the references, captured on a side
stream's CUDA graph, and a misaligned view gets its own compiled variant. Skipped without CUDA and triton."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.fusion import adaln, launch, rope
from worldfoundry.core.fusion.launch import alignment_mask, direct_launch, launch_path, precompile
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE) or interpreter_enabled(),
                                 reason="needs CUDA + triton, without TRITON_INTERPRET")]


def _gate_inputs(s: int = 256, c: int = 1536) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, s, c, generator=g).to("cuda", torch.bfloat16)
    y = torch.randn(1, s, c, generator=g).to("cuda", torch.bfloat16)
    table = torch.randn(6, c, generator=g).cuda()
    emb = torch.randn(1, 6, c, generator=g).cuda()
    return x, y, table, emb


def _plan(mode: int, shape: torch.Size) -> launch.KernelLauncher:
    return next(p for k, p in adaln._PLANS.items() if k[0] == mode and k[3] == shape)


def test_direct_path_is_taken_and_bitwise_equal_to_the_normal_path_and_the_reference() -> None:
    assert launch_path() == "direct", launch.direct_launch_unavailable_reason()
    x, y, table, emb = _gate_inputs()
    adaln._PLANS.clear()
    first = adaln.gated_residual(x, y, table, emb, 2, with_float=True)  # normal path, keeps the compiled kernel
    plan = _plan(adaln.MODE_GATE, x.shape)
    assert plan.variants() == 1
    direct = adaln.gated_residual(x, y, table, emb, 2, with_float=True)
    with direct_launch(False):
        normal = adaln.gated_residual(x, y, table, emb, 2, with_float=True)
    ref = adaln.reference_gated_residual(x, y, table, emb, 2, with_float=True)
    for got in (first, direct, normal):
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert plan.variants() == 1
    # the kernel kept is the one Triton's own cache returns for these arguments
    args = plan.arguments((direct[0], direct[1], x, y, table, emb), (2, 0))
    assert plan.warmup(args) is plan._compiled[(torch.cuda.current_device(), 0b111111)][3]


def test_rope_and_normalize_are_bitwise_through_the_direct_path() -> None:
    g = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(1, 64, 12, 128, generator=g).to("cuda", torch.bfloat16)
    k = torch.randn(1, 64, 12, 128, generator=g).to("cuda", torch.bfloat16)
    cos = torch.randn(1, 64, 1, 128, generator=g, dtype=torch.float64).cuda()
    sin = torch.randn(1, 64, 1, 128, generator=g, dtype=torch.float64).cuda()
    ref = rope.reference_rope_qk(q, k, cos, sin)
    for _ in range(3):
        got = rope.rope_qk(q, k, cos, sin)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    hidden = torch.randn(1, 2, 8, 64, generator=g).cuda()
    denom = torch.rand(1, 2, 1, 64, generator=g).to("cuda", torch.bfloat16)
    for _ in range(3):
        assert torch.equal(rope.sana_normalize(hidden, denom, torch.bfloat16),
                           rope.reference_sana_normalize(hidden, denom, torch.bfloat16))


def test_direct_launch_inside_a_cuda_graph_captured_on_a_side_stream() -> None:
    x, y, table, emb = _gate_inputs()
    adaln.gated_residual(x, y, table, emb, 2, with_float=True)
    adaln.gated_residual(x, y, table, emb, 2, with_float=True)  # direct from here on
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out, out32 = adaln.gated_residual(x, y, table, emb, 2, with_float=True)
    x2, y2 = torch.randn_like(x), torch.randn_like(y)
    x.copy_(x2)
    y.copy_(y2)
    graph.replay()
    torch.cuda.synchronize()
    ref = adaln.reference_gated_residual(x2, y2, table, emb, 2, with_float=True)
    assert torch.equal(out, ref[0]) and torch.equal(out32, ref[1])


def test_a_misaligned_view_compiles_and_uses_its_own_variant() -> None:
    x, y, table, emb = _gate_inputs()
    storage = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
    shifted = storage[1:].view(x.shape)  # 2 bytes past an aligned address
    shifted.copy_(y)
    assert alignment_mask([shifted]) == 0
    adaln._PLANS.clear()
    for _ in range(2):
        aligned = adaln.gated_residual(x, y, table, emb, 2, with_float=True)
    plan = _plan(adaln.MODE_GATE, x.shape)
    assert plan.variants() == 1
    for _ in range(2):
        misaligned = adaln.gated_residual(x, shifted, table, emb, 2, with_float=True)
    assert plan.variants() == 2  # one more specialization, the same plan
    compiled = {entry[3] for entry in plan._compiled.values()}
    assert len(compiled) == 2  # and a different compiled kernel
    for got in (aligned, misaligned, adaln.gated_residual(x, y, table, emb, 2, with_float=True)):
        assert torch.equal(got[0], adaln.reference_gated_residual(x, y, table, emb, 2)[0])


def test_precompile_fills_tritons_cache_so_the_first_launch_compiles_nothing(caplog: pytest.LogCaptureFixture
                                                                              ) -> None:
    x, y, table, emb = _gate_inputs(s=48, c=320)
    adaln._PLANS.clear()
    with caplog.at_level("WARNING", logger=launch.__name__), precompile() as jobs:
        adaln.gated_residual(x, y, table, emb, 2, with_float=True)
        adaln.modulate(x.float(), table, emb, 0, 1, out_dtype=torch.bfloat16)
    assert len(jobs) == 2
    assert not [r for r in caplog.records if "precompilation" in r.getMessage()]  # AsyncCompileMode compiled them
    for plan, args in jobs:  # compiled now: warm-up finds them in Triton's cache
        kernel = plan.warmup(args)
        assert hasattr(kernel, "run")
    got = adaln.gated_residual(x, y, table, emb, 2, with_float=True)
    assert torch.equal(got[1], adaln.reference_gated_residual(x, y, table, emb, 2, with_float=True)[1])
