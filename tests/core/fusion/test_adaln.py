"""AdaLN kernels vs their torch references vs the eager diffusers expressions, bitwise (Triton interpreter on CPU).

The eager expressions are copied from diffusers 0.42's ``WanTransformerBlock.forward`` /
``SanaVideoTransformerBlock.forward`` as they run there (modulation computed from the whole table, then split).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.core.fusion import adaln
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE, interpreter_enabled

pytestmark = pytest.mark.skipif(not (TRITON_AVAILABLE and interpreter_enabled()),
                                reason="needs triton with TRITON_INTERPRET=1")
BF16 = torch.bfloat16


def _wan_inputs(b: int, s: int, c: int, *, per_token: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s, c, generator=g) * 4).to(BF16)
    y = (torch.randn(b, s, c, generator=g) * 4).to(BF16)
    table = torch.randn(1, 6, c, generator=g) / c**0.5  # kept in float32 as diffusers keeps it
    temb = (torch.randn(b, s, 6, c, generator=g) if per_token else torch.randn(b, 6, c, generator=g)).to(BF16)
    norm = torch.nn.functional.layer_norm(x.float(), (c,), eps=1e-6)
    return x, y, table, temb, norm


def _wan_eager_mods(table, temb):
    if temb.ndim == 4:
        return [t.squeeze(2) for t in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    return list((table + temb.float()).chunk(6, dim=1))


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("limit", [2**31 - 1, 3])
def test_wan_chains_bitwise(per_token: bool, limit: int) -> None:
    x, y, table, temb, norm = _wan_inputs(2, 7, 40, per_token=per_token)
    shift, scale, gate, c_shift, c_scale, c_gate = _wan_eager_mods(table, temb)
    eager_mod = (norm * (1 + scale) + shift).type_as(x)
    eager_gate = (x.float() + y * gate).type_as(x)
    eager_ff_gate = (x.float() + y.float() * c_gate).type_as(x)
    eager_add = x + y
    kernel, kernel_f = adaln.modulate(norm, table[0], temb, 0, 1, out_dtype=BF16, with_float=True, index_limit=limit)
    ref, ref_f = adaln.reference_modulate(norm, table[0], temb, 0, 1, out_dtype=BF16, with_float=True)
    assert torch.equal(kernel, ref) and torch.equal(ref, eager_mod)
    assert torch.equal(kernel_f, ref_f) and torch.equal(kernel_f, eager_mod.float())
    for k, eager in ((2, eager_gate), (5, eager_ff_gate)):
        out, out_f = adaln.gated_residual(x, y, table[0], temb, k, with_float=True, index_limit=limit)
        assert torch.equal(out, adaln.reference_gated_residual(x, y, table[0], temb, k)[0])
        assert torch.equal(out, eager) and torch.equal(out_f, eager.float())
        out_xf, _ = adaln.gated_residual(x, y, table[0], temb, k, x_float=x.float(), index_limit=limit)
        assert torch.equal(out_xf, eager)
    out, out_f = adaln.residual_add(x, y, with_float=True, index_limit=limit)
    assert torch.equal(out, eager_add) and torch.equal(out_f, eager_add.float())
    assert torch.equal(adaln.reference_residual_add(x, y)[0], eager_add)


def test_strided_operands_and_noncontiguous_adaln_views() -> None:
    """``y`` as a transposed view, the modulation from a [B, 6C] projection viewed with strides."""
    x, _, table, _, norm = _wan_inputs(2, 5, 24)
    g = torch.Generator().manual_seed(3)
    y = torch.randn(2, 24, 5, generator=g).to(BF16).transpose(1, 2)  # channel stride 5
    proj = torch.randn(2, 6 * 24 + 8, generator=g).to(BF16)[:, 8:]  # a view into a wider buffer
    temb = proj.unflatten(1, (6, -1))
    assert not y.is_contiguous() and not temb.is_contiguous()
    mods = _wan_eager_mods(table, temb)
    out, _ = adaln.gated_residual(x, y, table[0], temb, 2)
    assert torch.equal(out, (x.float() + y * mods[2]).type_as(x))
    out, _ = adaln.modulate(norm, table[0], temb, 3, 4, out_dtype=BF16)
    assert torch.equal(out, (norm * (1 + mods[4]) + mods[3]).type_as(x))
    out, _ = adaln.residual_add(x, y)
    assert torch.equal(out, x + y)


@pytest.mark.parametrize("t", [1, 5])
def test_sana_per_op_chains_bitwise(t: int) -> None:
    """SANA-Video: one dtype, rounded after every operation, as eager's bfloat16 kernels round."""
    g = torch.Generator().manual_seed(4)
    b, s, c = 2, 5, 48
    x = torch.randn(b, s, c, generator=g).to(BF16)
    y = torch.randn(b, s, c, generator=g).to(BF16)
    table = (torch.randn(6, c, generator=g) / c**0.5).to(BF16)
    timestep = torch.randn(b, t, 6 * c, generator=g).to(BF16)
    norm = torch.nn.functional.layer_norm(x, (c,), eps=1e-6)
    emb = timestep.reshape(b, timestep.shape[1], 6, -1)
    shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = (table[None, None] + emb).unbind(dim=2)
    eager_mod = (norm * (1 + scale) + shift).to(x.dtype)
    out, _ = adaln.modulate(norm, table, emb, 0, 1, out_dtype=BF16, precision="per_op")
    assert torch.equal(out, eager_mod)
    assert torch.equal(out, adaln.reference_modulate(norm, table, emb, 0, 1, out_dtype=BF16, precision="per_op")[0])
    out, _ = adaln.gated_residual(x, y, table, emb, 2, precision="per_op")
    assert torch.equal(out, x + gate * y)
    out, _ = adaln.gated_residual(x, y, table, emb, 5, precision="per_op")
    assert torch.equal(out, x + gate_mlp * y)
    assert torch.equal(adaln.residual_add(y, x)[0], y + x)
    # the per-op rounding matters: float32-then-round differs somewhere for these inputs
    single = (norm.float() * (1 + (table[1].float() + emb[:, :, 1].float())) + (table[0].float() + emb[:, :, 0].float()))
    assert not torch.equal(single.to(BF16), eager_mod)


def test_float32_model_chains_bitwise() -> None:
    x, y, table, temb, norm = _wan_inputs(1, 6, 32)
    x, y, temb = x.float(), y.float(), temb.float()
    mods = _wan_eager_mods(table, temb)
    out, _ = adaln.modulate(norm, table[0], temb, 0, 1, out_dtype=torch.float32)
    assert torch.equal(out, (norm * (1 + mods[1]) + mods[0]).type_as(x))
    out, _ = adaln.gated_residual(x, y, table[0], temb, 2)
    assert torch.equal(out, (x.float() + y * mods[2]).type_as(x))


def test_forced_64_bit_indexing_matches_32_bit() -> None:
    x, y, table, temb, norm = _wan_inputs(3, 9, 130)
    for fn in (lambda lim: adaln.modulate(norm, table[0], temb, 0, 1, out_dtype=BF16, index_limit=lim)[0],
               lambda lim: adaln.gated_residual(x, y, table[0], temb, 2, index_limit=lim)[0],
               lambda lim: adaln.residual_add(x, y, index_limit=lim)[0]):
        assert torch.equal(fn(2**31 - 1), fn(0))


@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(1, 9), c=st.integers(1, 70), k=st.integers(0, 5), seed=st.integers(0, 99))
def test_gated_residual_equals_eager_for_any_shape(b: int, s: int, c: int, k: int, seed: int) -> None:
    """Invariant: for every shape (masked tails, one-column rows) the kernel is the eager expression."""
    x, y, table, temb, _ = _wan_inputs(b, s, c, seed=seed)
    gate = _wan_eager_mods(table, temb)[k]
    assert torch.equal(adaln.gated_residual(x, y, table[0], temb, k)[0], (x.float() + y * gate).type_as(x))


def test_programs_with_one_sample_per_tile_load_the_modulation_once() -> None:
    """S a multiple of the row block (the per-sample fast path) and not, with two samples: both bitwise."""
    for s in (16, 13):
        x, y, table, temb, norm = _wan_inputs(2, s, 512, seed=s)
        mods = _wan_eager_mods(table, temb)
        out, _ = adaln.modulate(norm, table[0], temb, 0, 1, out_dtype=BF16)
        assert torch.equal(out, (norm * (1 + mods[1]) + mods[0]).type_as(x))
        out, _ = adaln.gated_residual(x, y, table[0], temb, 5, index_limit=0)
        assert torch.equal(out, (x.float() + y.float() * mods[5]).type_as(x))
