"""Error-compensating (GPTQ) rounding of the INT4 residual: the artifact format of round-to-nearest, a smaller
output error on correlated inputs, round-to-nearest itself where inputs are uncorrelated, and the calibration
plumbing (second moments collected, the choice recorded, refused without them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from worldfoundry.base_models.diffusion_model.svdquant_calibration import (
    InputAbsmaxObserver,
    build_svdquant_artifact,
    select_for_calibration,
)
from worldfoundry.core.acceleration.quantization.gptq_rounding import (
    gptq_quantize_int4,
    searched_scales,
    smoothed_hessian,
)
from worldfoundry.core.acceleration.quantization.int4_packing import (
    dequantize_int4_groupwise,
    quantize_int4_groupwise,
    unpack_int4,
)
from worldfoundry.core.acceleration.quantization.svdquant_artifact import (
    load_svdquant_artifact,
    save_svdquant_artifact,
)
from worldfoundry.core.acceleration.quantization.svdquant_numerics import decompose, w4a16_linear_reference
from worldfoundry.errors import InvalidRequestError, QuantizationInputError


def _correlated(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) @ (torch.randn(k, k, generator=g) / k**0.5) + torch.randn(k, generator=g)


def _output_error(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int) -> float:
    ref = x @ w.t()
    return float((x @ dequantize_int4_groupwise(packed, scales, group).t() - ref).norm() / ref.norm())


@pytest.mark.parametrize("group", [64, 128, 0])
@pytest.mark.parametrize("n,k", [(96, 256), (40, 384)])
def test_format_of_round_to_nearest_and_a_smaller_output_error(group: int, n: int, k: int) -> None:
    x = _correlated(2048, k, seed=k + group)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) / k**0.5
    packed, scales = gptq_quantize_int4(w, x.t() @ x, group)
    rtn_packed, rtn_scales = quantize_int4_groupwise(w, group)
    assert packed.shape == rtn_packed.shape and packed.dtype == rtn_packed.dtype
    assert scales.shape == rtn_scales.shape and scales.dtype == rtn_scales.dtype
    codes = unpack_int4(packed, group)
    assert int(codes.min()) >= -8 and int(codes.max()) <= 7
    gptq, rtn = _output_error(x, w, packed, scales, group), _output_error(x, w, rtn_packed, rtn_scales, group)
    assert gptq < 0.75 * rtn, (gptq, rtn)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 24), groups=st.integers(1, 3), seed=st.integers(0, 1000))
def test_uncorrelated_unit_inputs_give_round_to_nearest(n: int, groups: int, seed: int) -> None:
    """With ``H = I`` no column's error has anywhere to go: the codes and scales are round-to-nearest's."""
    k = 64 * groups
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    packed, scales = gptq_quantize_int4(w, torch.eye(k), 64)
    rtn_packed, rtn_scales = quantize_int4_groupwise(w, 64)
    assert torch.equal(scales, rtn_scales) and torch.equal(packed, rtn_packed)


def test_dead_inputs_and_bad_shapes() -> None:
    x = _correlated(512, 128, seed=3)
    x[:, 5] = 0.0  # an input that never varied: its diagonal is 0
    w = torch.randn(8, 128)
    packed, _ = gptq_quantize_int4(w, x.t() @ x, 64)
    assert packed.shape == (8, 64)
    with pytest.raises(QuantizationInputError, match="do not match"):
        gptq_quantize_int4(w, torch.eye(64), 64)
    with pytest.raises(QuantizationInputError):
        gptq_quantize_int4(torch.randn(8, 96), torch.eye(96), 64)


def test_smoothed_moments_are_those_of_the_smoothed_inputs() -> None:
    x = _correlated(64, 16, seed=5)
    s = torch.rand(16) + 0.5
    torch.testing.assert_close(smoothed_hessian(x.t() @ x, s), (x / s).t() @ (x / s), rtol=1e-5, atol=1e-4)


def test_decompose_with_moments_lowers_the_output_error_of_svdquant() -> None:
    x = _correlated(2048, 256, seed=9)
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(2)) / 16
    amax = x.abs().amax(0)
    ref = x @ w.t()
    errors = {}
    for name, hessian in (("nearest", None), ("gptq", x.t() @ x)):
        q = decompose(w, rank=8, group_size=64, act_absmax=amax, hessian=hessian)
        errors[name] = float((w4a16_linear_reference(x, q) - ref).norm() / ref.norm())
    assert errors["gptq"] < 0.75 * errors["nearest"], errors


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))


def test_calibration_collects_moments_records_the_rounding_and_refuses_without_them(tmp_path) -> None:
    model = _model()
    selected = select_for_calibration(model, ["0", "2"])
    with InputAbsmaxObserver(selected) as plain:
        model(torch.randn(10, 64))
    with pytest.raises(InvalidRequestError, match="second moments"):
        build_svdquant_artifact(model, selected, plain.absmax, rank=8, group_size=64, observer=plain, rounding="gptq")
    with pytest.raises(InvalidRequestError, match="--rounding must be one of"):
        build_svdquant_artifact(model, selected, plain.absmax, rank=8, group_size=64, observer=plain,
                                rounding="stochastic")
    x = torch.randn(10, 64)
    with InputAbsmaxObserver(selected, second_moments=True) as obs:
        model(x)
    torch.testing.assert_close(obs.moments["0"], x.t() @ x)
    manifest, tensors = build_svdquant_artifact(model, selected, obs.absmax, rank=8, group_size=64, observer=obs,
                                                include=["0", "2"], rounding="gptq")
    assert manifest["calibration"]["rounding"] == "gptq"
    art = load_svdquant_artifact(save_svdquant_artifact(manifest, tensors, tmp_path / "g.json"))
    assert set(art.linears) == {"0", "2"}


def _heterogeneous(rows: int, k: int, seed: int) -> torch.Tensor:
    """Correlated inputs whose channels differ in magnitude by up to e^3 (as activations do)."""
    g = torch.Generator().manual_seed(seed)
    return _correlated(rows, k, seed) * torch.exp(1.5 * torch.randn(k, generator=g))


@pytest.mark.parametrize("group", [64, 0])
def test_ordered_rounding_keeps_the_format_and_lowers_the_output_error_further(group: int) -> None:
    x = _heterogeneous(4096, 256, seed=21)
    w = torch.randn(192, 256, generator=torch.Generator().manual_seed(4)) / 16
    w[:, :3] *= 6  # a few large input columns, which set absmax scales
    h = x.t() @ x
    packed, scales = gptq_quantize_int4(w, h, group, ordered=True)
    plain_packed, plain_scales = gptq_quantize_int4(w, h, group)
    assert packed.shape == plain_packed.shape and scales.shape == plain_scales.shape
    assert scales.dtype == torch.bfloat16
    codes = unpack_int4(packed, group)
    assert int(codes.min()) >= -8 and int(codes.max()) <= 7
    ordered = _output_error(x, w, packed, scales, group)
    plain = _output_error(x, w, plain_packed, plain_scales, group)
    assert ordered < 0.8 * plain, (ordered, plain)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12), groups=st.integers(1, 3), per_channel=st.booleans(), seed=st.integers(0, 10_000))
def test_searched_scales_are_never_worse_than_absmax(n: int, groups: int, per_channel: bool, seed: int) -> None:
    """Per output feature and group, the searched scale's weighted round-to-nearest error is at most absmax's
    (1.0 is among the fractions tried), and every scale is a fraction in [0.6, 1] of absmax / 7."""
    k = 128 * groups
    group = 0 if per_channel else 64
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(k, generator=g))
    importance = torch.rand(k, generator=g)
    searched = searched_scales(w, importance, group)
    absmax = quantize_int4_groupwise(w, group)[1]
    assert searched.shape == absmax.shape and searched.dtype == torch.bfloat16

    def weighted_error(scales: torch.Tensor) -> torch.Tensor:
        width = k // scales.shape[0]
        s = scales.float().t().repeat_interleave(width, dim=1)
        q = torch.round(w / s).clamp(-8, 7)
        return ((w - q * s).square() * importance).reshape(n, scales.shape[0], width).sum(-1)

    assert bool((weighted_error(searched) <= weighted_error(absmax) * (1 + 1e-6) + 1e-12).all())
    ratio = searched.float() / absmax.float()
    assert bool((ratio > 0.59).all()) and bool((ratio < 1.01).all())


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 16), groups=st.integers(1, 3), seed=st.integers(0, 1000))
def test_ordered_rounding_with_uncorrelated_equal_inputs_is_nearest_under_the_searched_scales(
        n: int, groups: int, seed: int) -> None:
    """``H = I``: the order is the identity, no error moves, so the codes are round-to-nearest's under the
    searched scales."""
    k = 64 * groups
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    packed, scales = gptq_quantize_int4(w, torch.eye(k), 64, ordered=True)
    assert torch.equal(scales, searched_scales(w, torch.ones(k), 64))
    expected = torch.round(w / scales.float().t().repeat_interleave(64, dim=1)).clamp(-8, 7).to(torch.int8)
    assert torch.equal(unpack_int4(packed, 64), expected)


def test_calibration_records_the_ordered_rounding(tmp_path) -> None:
    model = _model()
    selected = select_for_calibration(model, ["0", "2"])
    with InputAbsmaxObserver(selected, second_moments=True) as obs:
        model(torch.randn(32, 64))
    with pytest.raises(InvalidRequestError, match="second moments"):
        with InputAbsmaxObserver(selected) as plain:
            model(torch.randn(4, 64))
        build_svdquant_artifact(model, selected, plain.absmax, rank=8, group_size=64, observer=plain,
                                rounding="gptq-ordered")
    manifest, tensors = build_svdquant_artifact(model, selected, obs.absmax, rank=8, group_size=64, observer=obs,
                                                include=["0", "2"], rounding="gptq-ordered")
    assert manifest["calibration"]["rounding"] == "gptq-ordered"
    art = load_svdquant_artifact(save_svdquant_artifact(manifest, tensors, tmp_path / "o.json"))
    assert set(art.linears) == {"0", "2"}


def test_decompose_names_the_roundings_it_takes() -> None:
    w = torch.randn(16, 128)
    with pytest.raises(QuantizationInputError, match="gptq-ordered"):
        decompose(w, rank=4, group_size=64, rounding="ordered", hessian=torch.eye(128))
    with pytest.raises(QuantizationInputError, match="second moments"):
        decompose(w, rank=4, group_size=64, rounding="gptq-ordered")
