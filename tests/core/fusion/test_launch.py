"""The launch plans of the fusion kernels (CPU, Triton interpreter): specialization keys, argument order,
recording for precompilation, and bitwise results through :class:`KernelLauncher`."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.fusion import adaln, compile_pool, launch, rope
from worldfoundry.core.fusion.launch import (
    POINTER_ALIGNMENT,
    KernelLauncher,
    alignment_mask,
    direct_launch,
    direct_launch_unavailable_reason,
    launch_path,
    precompile,
)
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled

needs_kernels = pytest.mark.skipif(not (TRITON_AVAILABLE and interpreter_enabled()),
                                   reason="needs triton and TRITON_INTERPRET=1 (CPU kernels)")


def test_alignment_mask_marks_each_pointer_aligned_to_16_bytes() -> None:
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert base.data_ptr() % POINTER_ALIGNMENT == 0
    views = [base, base[1:], base[8:], base[3:]]  # bfloat16: 2 bytes, so offsets 8 and 0 are aligned
    assert alignment_mask(views) == 0b0101
    assert alignment_mask([]) == 0


def test_direct_launch_switch_restores_the_previous_state() -> None:
    before = direct_launch_unavailable_reason()
    with direct_launch(False):
        assert direct_launch_unavailable_reason() is not None
        assert launch_path() in ("interpreter", "normal")
        with direct_launch(True):
            assert direct_launch_unavailable_reason() == before
    assert direct_launch_unavailable_reason() == before


@needs_kernels
def test_plan_arguments_follow_the_kernel_signature() -> None:
    x = torch.randn(1, 8, 48, dtype=torch.bfloat16)
    y = torch.randn(1, 8, 48, dtype=torch.bfloat16)
    adaln._PLANS.clear()
    adaln.residual_add(x, y)
    (plan,) = adaln._PLANS.values()
    assert isinstance(plan, KernelLauncher) and plan.interpreted
    args = plan.arguments((x, x, x, y, x, x), (0, 0))
    names = adaln._adaln_kernel.arg_names
    assert len(args) == len(names)
    constexprs = dict(zip(names, args, strict=True))
    assert constexprs["MODE"] == adaln.MODE_ADD and constexprs["BLOCK_C"] == 64
    assert constexprs["R"] == 8 and constexprs["C"] == 48


@needs_kernels
def test_constexprs_must_close_the_signature() -> None:
    with pytest.raises(ValueError, match="constexpr parameters must come last"):
        KernelLauncher(adaln._adaln_kernel, (1,), n_pointers=6, fixed=(), constexprs={"R": 1})


@needs_kernels
def test_precompile_records_launches_and_runs_nothing() -> None:
    x = torch.randn(1, 8, 48, dtype=torch.bfloat16)
    table = torch.randn(6, 48)
    emb = torch.randn(1, 6, 48)
    q = torch.randn(1, 8, 2, 24)
    adaln._PLANS.clear()
    with precompile() as jobs:
        adaln.gated_residual(x, x, table, emb, 2)
        rope.rope_qk(q, q, torch.ones(1, 8, 1, 24), torch.ones(1, 8, 1, 24))
        plan = next(iter(adaln._PLANS.values()))
        out = torch.full((1, 8, 48), 7.0, dtype=torch.bfloat16)
        plan((out, out, x, x, table, emb), (2, 0))
    assert [type(j[0]) for j in jobs] == [KernelLauncher] * 3
    assert jobs[0][0] is plan and jobs[2][0] is plan  # the recorded plan is the one later launches use
    assert len(jobs[0][1]) == len(adaln._adaln_kernel.arg_names)
    assert torch.all(out == 7.0)  # recorded, not run
    plan((out, out, x, x, table, emb), (2, 0))
    assert torch.equal(out, adaln.reference_gated_residual(x, x, table, emb, 2)[0])  # outside the block it runs
    with pytest.raises(RuntimeError, match="do not nest"), precompile(), precompile():
        pass
    assert launch._LOCAL.recording is None


@needs_kernels
def test_precompile_records_only_the_calling_threads_launches() -> None:
    import threading

    x = torch.randn(1, 8, 48, dtype=torch.bfloat16)
    results = []
    with precompile() as jobs:
        worker = threading.Thread(target=lambda: results.append(adaln.residual_add(x, x)[0]))
        worker.start()
        worker.join()
    assert jobs == [] and torch.equal(results[0], x + x)  # the other thread's launch ran


@needs_kernels
def test_results_through_the_launcher_are_bitwise_the_references() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 80, generator=g).to(torch.bfloat16)
    y = torch.randn(2, 16, 80, generator=g).to(torch.bfloat16)
    table = torch.randn(6, 80, generator=g)
    emb = torch.randn(2, 6, 80, generator=g)
    for _ in range(2):  # the second call reuses the plan (and, on CUDA, launches directly)
        out, f = adaln.gated_residual(x, y, table, emb, 2, with_float=True)
        ref, ref_f = adaln.reference_gated_residual(x, y, table, emb, 2, with_float=True)
        assert torch.equal(out, ref) and torch.equal(f, ref_f)
        n = torch.randn(2, 16, 80, generator=g)
        out, _ = adaln.modulate(n, table, emb, 0, 1, out_dtype=torch.bfloat16)
        assert torch.equal(out, adaln.reference_modulate(n, table, emb, 0, 1, out_dtype=torch.bfloat16)[0])
    hidden = torch.randn(1, 2, 4, 16, generator=g)
    denom = torch.rand(1, 2, 1, 16, generator=g).to(torch.bfloat16)
    for _ in range(2):
        got = rope.sana_normalize(hidden, denom, torch.bfloat16)
        assert torch.equal(got, rope.reference_sana_normalize(hidden, denom, torch.bfloat16))
    with pytest.raises(ValueError, match="float32 hidden"):
        rope.sana_normalize(hidden.half(), denom, torch.bfloat16)


def test_warm_compiler_runs_once_and_never_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_pool, "_WARM", [])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launch.warm_compiler()
    assert compile_pool._WARM == []  # nothing to compile under the interpreter
    if not TRITON_AVAILABLE:
        return
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    launch.warm_compiler()
    threads = list(compile_pool._WARM)
    # the compiler key, and the driver's utility module where CUDA is available
    assert len(threads) == (2 if torch.cuda.is_available() else 1)
    launch.warm_compiler()
    assert compile_pool._WARM == threads  # once per process
    compile_pool.wait_warm()
    assert not any(t.is_alive() for t in threads)
    from triton.runtime.cache import triton_key

    assert triton_key.cache_info().currsize == 1  # the key is computed and kept for the first compilation
