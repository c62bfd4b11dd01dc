"""Wan's Q/K RMSNorm + rotary kernel (``core/fusion/qk_norm_rope``) against its torch reference (CPU, Triton
interpreter, bitwise), the reference against eager (the reproduced RMSNorm + the processor's rotary, bitwise;
diffusers' own ``WanAttnProcessor`` with PyTorch's CPU RMSNorm, bitwise where the norms agree), and the refusals
of :func:`reason`. The kernel against real CUDA eager is in ``test_qk_norm_rope_gpu.py``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.fusion import qk_norm_rope
from worldfoundry.core.fusion.layer_norm_reference import reference_rms_norm
from worldfoundry.core.fusion.qk_norm_rope import reason, reference_rms_norm_rope_qk, rms_norm_rope_qk
from worldfoundry.core.fusion.rope import reference_rope
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled

needs_interpreter = pytest.mark.skipif(not (TRITON_AVAILABLE and interpreter_enabled()),
                                       reason="needs triton with TRITON_INTERPRET=1")
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def _operands(b: int, s: int, h: int, d: int, dtype: torch.dtype, freq_dtype: torch.dtype, freq_batch: int,
              seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    c = h * d
    q = (torch.randn(b, s, c, generator=g) * 3 + 0.5).to(dtype)
    k = (torch.randn(b, s, c, generator=g) * 0.7).to(dtype)
    wq = (torch.randn(c, generator=g) * 0.5 + 1).to(dtype)
    wk = (torch.randn(c, generator=g) * 0.5 + 1).to(dtype)
    angle = torch.rand(freq_batch, s, 1, d, generator=g, dtype=F64) * 6.3
    return q, k, wq, wk, torch.cos(angle).to(freq_dtype), torch.sin(angle).to(freq_dtype)


def _check_bitwise(q, k, wq, wk, cos, sin, h: int, eps_q: float = 1e-6, eps_k: float = 1e-5,
                   limit: int = 2**31 - 1) -> None:
    out_q, out_k = rms_norm_rope_qk(q, k, wq, wk, eps_q, eps_k, h, cos, sin, index_limit=limit)
    ref_q, ref_k = reference_rms_norm_rope_qk(q, k, wq, wk, eps_q, eps_k, h, cos, sin, approx_rsqrt=False)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    assert _bits_equal(out_q, ref_q), int((out_q != ref_q).sum())
    assert _bits_equal(out_k, ref_k), int((out_k != ref_k).sum())


@needs_interpreter
@pytest.mark.parametrize("b,s,h,d", [(1, 3, 2, 8), (2, 37, 4, 32), (1, 13, 3, 16), (2, 5, 2, 24), (1, 3, 5, 128)])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("freq_dtype", [F64, F32])
def test_kernel_matches_the_reference_bitwise(b: int, s: int, h: int, d: int, dtype: torch.dtype,
                                              freq_dtype: torch.dtype) -> None:
    """Rows not a multiple of the 8 per program (3, 13, 37, 74), widths below one chunk (16 to 96, powers of two
    and not) and above it (640: two chunks, the second partial, and two vectors of 128 lanes per thread)."""
    for freq_batch in sorted({1, b}):
        _check_bitwise(*_operands(b, s, h, d, dtype, freq_dtype, freq_batch, seed=s + d), h)


@needs_interpreter
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_forced_64_bit_indexing_stays_bitwise(dtype: torch.dtype) -> None:
    q, k, wq, wk, cos, sin = _operands(2, 11, 3, 16, dtype, F64, 2, seed=4)
    qk_norm_rope._PLANS.clear()
    _check_bitwise(q, k, wq, wk, cos, sin, 3, limit=40)
    (plan,) = qk_norm_rope._PLANS.values()
    assert plan._kwargs["INDEX_64"] is True
    assert plan.grid == (3, 2)  # one launch: 22 rows in programs of 8, and axis 1 for Q and K


@needs_interpreter
def test_one_launch_for_query_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from worldfoundry.core.fusion.launch import KernelLauncher

    launches: list[tuple[int, ...]] = []
    original = KernelLauncher.normal

    def counting(self, pointers, scalars):  # noqa: ANN001
        launches.append(self.grid)
        return original(self, pointers, scalars)

    monkeypatch.setattr(KernelLauncher, "normal", counting)
    q, k, wq, wk, cos, sin = _operands(1, 9, 2, 8, BF16, F64, 1, seed=5)
    rms_norm_rope_qk(q, k, wq, wk, 1e-6, 1e-6, 2, cos, sin)
    assert launches == [(2, 2)]


@needs_interpreter
def test_eager_rounding_between_the_norm_and_the_rotary_matters() -> None:
    """The kernel rounds the normalised value to bfloat16 before rotating it in float64, as eager does: rotating
    the unrounded float32 value differs (so the test above would see a kernel that skips the rounding)."""
    h = 4
    q, k, wq, wk, cos, sin = _operands(1, 16, h, 32, BF16, F64, 1, seed=6)
    out_q, _ = rms_norm_rope_qk(q, k, wq, wk, 1e-6, 1e-6, h, cos, sin)
    unrounded = reference_rms_norm(q, 1e-6, wq, out_dtype=F32, approx_rsqrt=False).unflatten(2, (h, -1))
    skipped = reference_rope(unrounded, cos, sin).to(BF16)
    assert not torch.equal(out_q, skipped)


def test_reference_is_the_reproduced_norm_then_the_processors_rotary() -> None:
    h = 3
    q, k, wq, wk, cos, sin = _operands(2, 7, h, 16, BF16, F64, 1, seed=7)
    for approx in (False, True):
        ref_q, ref_k = reference_rms_norm_rope_qk(q, k, wq, wk, 1e-6, 1e-5, h, cos, sin, approx_rsqrt=approx)
        norm_q = reference_rms_norm(q, 1e-6, wq, approx_rsqrt=approx).unflatten(2, (h, -1))
        norm_k = reference_rms_norm(k, 1e-5, wk, approx_rsqrt=approx).unflatten(2, (h, -1))
        assert _bits_equal(ref_q, reference_rope(norm_q, cos, sin))
        assert _bits_equal(ref_k, reference_rope(norm_k, cos, sin))


def _wan_processor_qk(monkeypatch: pytest.MonkeyPatch, query, key, weight_q, weight_k, eps: float, heads: int,
                      cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K as diffusers' ``WanAttnProcessor`` hands them to attention (its RMSNorm modules and its rotary)."""
    from diffusers.models.transformers import transformer_wan

    c = query.shape[-1]
    attn = transformer_wan.WanAttention(dim=c, heads=heads, dim_head=c // heads, eps=eps,
                                        processor=transformer_wan.WanAttnProcessor())
    attn = attn.to(device=query.device, dtype=query.dtype)
    with torch.no_grad():
        attn.norm_q.weight.copy_(weight_q)
        attn.norm_k.weight.copy_(weight_k)
    seen: dict[str, torch.Tensor] = {}

    class Captured(Exception):
        pass

    def dispatch(q, k, v, **kwargs):  # noqa: ANN001, ANN003
        seen["q"], seen["k"] = q, k
        raise Captured

    monkeypatch.setattr(transformer_wan, "_get_qkv_projections", lambda a, hs, ehs: (query, key, query))
    monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", dispatch)
    with torch.no_grad(), pytest.raises(Captured):
        attn(query, rotary_emb=(cos, sin))
    return seen["q"], seen["k"]


def test_reference_against_diffusers_wan_processor(monkeypatch: pytest.MonkeyPatch) -> None:
    """diffusers' processor on the CPU: its rotary is :func:`reference_rope` bitwise (on PyTorch's CPU RMSNorm);
    with ``approx_rsqrt=True`` the reference is bitwise eager wherever its RMSNorm row equals the CPU one (another
    reduction order: most rows, not all), and within one rounding step of the rotary's output elsewhere."""
    h, d = 4, 32
    q, k, wq, wk, cos, sin = _operands(1, 64, h, d, BF16, F64, 1, seed=8)
    eager_q, eager_k = _wan_processor_qk(monkeypatch, q, k, wq, wk, 1e-6, h, cos, sin)
    for x, w, eager in ((q, wq, eager_q), (k, wk, eager_k)):
        cpu_norm = F.rms_norm(x, (h * d,), w, 1e-6)
        assert _bits_equal(eager, reference_rope(cpu_norm.unflatten(2, (h, -1)), cos, sin))
    ref_q, ref_k = reference_rms_norm_rope_qk(q, k, wq, wk, 1e-6, 1e-6, h, cos, sin, approx_rsqrt=True)
    for x, w, ref, eager in ((q, wq, ref_q, eager_q), (k, wk, ref_k, eager_k)):
        same_rows = (reference_rms_norm(x, 1e-6, w, approx_rsqrt=True) == F.rms_norm(x, (h * d,), w, 1e-6)).all(-1)
        assert bool(same_rows.any())
        assert _bits_equal(ref[same_rows], eager[same_rows])
        torch.testing.assert_close(ref.float(), eager.float(), rtol=2**-7, atol=2**-7)


def _refusals() -> dict[str, tuple]:
    """Operand sets :func:`reason` refuses, by the words the reason must contain."""
    q, k, wq, wk, cos, sin = _operands(2, 5, 2, 8, BF16, F64, 1)
    misaligned = torch.empty(q.numel() + 1, dtype=BF16)[1:].view(q.shape).copy_(q)  # 2 bytes past 8-byte alignment
    bad_weight = torch.empty(17, dtype=BF16)[1:].copy_(wq)
    return {
        "float16": (q.half(), k.half(), wq.half(), wk.half(), cos, sin, 2),
        "dtype": (q, k.float(), wq, wk, cos, sin, 2),
        "shapes": (q, k[:, :4], wq, wk, cos, sin, 2),
        "contiguous": (q.transpose(0, 1).contiguous().transpose(0, 1), k, wq, wk, cos, sin, 2),
        "aligned": (misaligned, k, wq, wk, cos, sin, 2),
        "divisible": (q, k, wq, wk, cos, sin, 3),
        "odd head dim": (q[..., :12].contiguous(), k[..., :12].contiguous(), wq[:12], wk[:12], cos[..., :3],
                         sin[..., :3], 4),
        "multiple of 4": (q[..., :6].contiguous(), k[..., :6].contiguous(), wq[:6], wk[:6], cos[..., :2],
                          sin[..., :2], 3),
        "weight_q": (q, k, wq.float(), wk, cos, sin, 2),
        "weight_k": (q, k, wq, wk[:8], cos, sin, 2),
        "weight not": (q, k, bad_weight, wk, cos, sin, 2),
        "freqs dtype": (q, k, wq, wk, cos.to(BF16), sin.to(BF16), 2),
        "both the same": (q, k, wq, wk, cos, sin.float(), 2),
        "freqs shapes": (q, k, wq, wk, cos[:, :4], sin[:, :4], 2),
        "[1 or 2": (q, k, wq, wk, cos.expand(3, -1, -1, -1), sin.expand(3, -1, -1, -1), 2),
        "strides": (q, k, wq, wk, cos, sin.transpose(1, 3).contiguous().transpose(1, 3), 2),
        "devices": (q, k, wq, wk, cos.to("meta"), sin.to("meta"), 2),
    }


@pytest.mark.parametrize("words", list(_refusals()))
def test_reason_refuses(words: str) -> None:
    why = reason(*_refusals()[words])
    assert why is not None and words in why, why


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("freq_dtype", [F64, F32])
def test_reason_accepts_wans_operands(dtype: torch.dtype, freq_dtype: torch.dtype) -> None:
    q, k, wq, wk, cos, sin = _operands(2, 5, 2, 8, dtype, freq_dtype, 2)
    assert reason(q, k, wq, wk, cos, sin, 2) is None
    assert reason(q, k, wq, wk, cos[:1], sin[:1], 2) is None
    # Wan's rotary module builds its frequencies by expand / cat / reshape: any strides, as long as cos and sin agree
    wide = torch.cat([cos, cos], dim=-1)[..., ::2]
    assert reason(q, k, wq, wk, wide, torch.cat([sin, sin], dim=-1)[..., ::2], 2) is None


def test_kernel_refuses_operands_outside_its_scope() -> None:
    q, k, wq, wk, cos, sin = _operands(1, 5, 2, 8, BF16, F64, 1)
    with pytest.raises(ValueError, match="divisible"):
        rms_norm_rope_qk(q, k, wq, wk, 1e-6, 1e-6, 3, cos, sin)


@needs_interpreter
@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 2), s=st.integers(1, 12), h=st.integers(1, 4), pairs=st.integers(1, 20),
       dtype=st.sampled_from([BF16, F32]), freq_dtype=st.sampled_from([F64, F32]), batch_freqs=st.booleans(),
       seed=st.integers(0, 2**16), wide=st.booleans())
def test_kernel_is_the_reference_on_random_shapes(b: int, s: int, h: int, pairs: int, dtype: torch.dtype,
                                                  freq_dtype: torch.dtype, batch_freqs: bool, seed: int,
                                                  wide: bool) -> None:
    d = 2 * pairs
    if (h * d) % 4:  # PyTorch's vectorized RMSNorm (the reproduced one) needs a multiple of 4
        d *= 2
    operands = _operands(b, s, h, d, dtype, freq_dtype, b if batch_freqs else 1, seed=seed)
    assert reason(*operands, h) is None
    _check_bitwise(*operands, h, limit=64 if wide else 2**31 - 1)


def test_module_imports_without_triton() -> None:
    code = ("import sys\nsys.modules['triton'] = None\n"
            "import worldfoundry.core.fusion.qk_norm_rope as m\n"
            "assert not m.TRITON_AVAILABLE\nprint('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@needs_interpreter
@pytest.mark.parametrize("b,s", [(1, 5), (2, 7), (3, 1)])
def test_chunks_of_a_packed_projection_are_read_in_place(b: int, s: int) -> None:
    """Q and K as chunks of one fused ``[B, S, 3C]`` projection output (rows ``3C`` apart), as ``optimized_mha`` and
    diffusers' fused projections hand them over: the same values as their contiguous copies, so the same bits."""
    h, d = 2, 16
    q, k, wq, wk, cos, sin = _operands(b, s, h, d, BF16, F64, 1, seed=b + s)
    packed = torch.cat([q, k, q], dim=-1)
    qc, kc, _ = packed.chunk(3, dim=-1)
    assert qk_norm_rope.row_stride(qc) == (3 * h * d if s > 1 else packed.stride(0))
    assert reason(qc, kc, wq, wk, cos, sin, h) is None
    out = rms_norm_rope_qk(qc, kc, wq, wk, 1e-6, 1e-5, h, cos, sin)
    ref = rms_norm_rope_qk(q, k, wq, wk, 1e-6, 1e-5, h, cos, sin)
    assert _bits_equal(out[0], ref[0]) and _bits_equal(out[1], ref[1])
    _check_bitwise(qc, kc, wq, wk, cos, sin, h)


def test_row_stride_of_layouts() -> None:
    x = torch.zeros(2, 3, 8)
    assert qk_norm_rope.row_stride(x) == 8
    assert qk_norm_rope.row_stride(torch.zeros(2, 3, 24)[..., 8:16]) == 24
    assert qk_norm_rope.row_stride(x.transpose(0, 1)) is None  # batches interleaved with tokens
    assert qk_norm_rope.row_stride(torch.zeros(2, 3, 16)[..., ::2]) is None  # channels not contiguous
    assert qk_norm_rope.row_stride(torch.zeros(3, 8)) is None
