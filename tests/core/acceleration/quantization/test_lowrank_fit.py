"""The SVDQuant low-rank pair fitted to the calibration outputs (whitened) and refined against the INT4 residual:
optimal under its norm, never worse than the first split when refined, the shipped default unchanged, the
calibration plumbing (moments collected, choices recorded, bad settings refused in one line)."""

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
from worldfoundry.core.acceleration.quantization.lowrank_fit import (
    MAX_REFINE,
    fit_lowrank,
    output_error,
    whitening_factor,
)
from worldfoundry.core.acceleration.quantization.svdquant_artifact import (
    load_svdquant_artifact,
    save_svdquant_artifact,
)
from worldfoundry.core.acceleration.quantization.svdquant_numerics import decompose, w4a8_linear_reference
from worldfoundry.errors import InvalidRequestError, QuantizationInputError


def _inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    """Correlated inputs with channel scales spread over two decades (what makes whitening matter)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5
    return (torch.randn(rows, k, generator=g) @ mix) * torch.logspace(-1, 1, k)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(8, 40), k=st.integers(8, 40), rank=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_whitened_pair_is_the_best_rank_r_under_the_output_norm(n: int, k: int, rank: int, seed: int) -> None:
    rank = min(rank, n, k)
    x = _inputs(4 * k, k, seed)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1))
    c = whitening_factor(x.t() @ x)
    up_w, down_w = fit_lowrank(w, rank, whiten=c)
    up_s, down_s = fit_lowrank(w, rank)
    whitened = output_error(w - up_w @ down_w, c)
    plain = output_error(w - up_s @ down_s, c)
    assert whitened <= plain * (1 + 1e-4) + 1e-6
    # and the plain SVD pair is the best one in the weight norm
    assert output_error(w - up_s @ down_s, None) <= output_error(w - up_w @ down_w, None) * (1 + 1e-4) + 1e-6


def test_whitening_by_identity_moments_is_the_plain_svd() -> None:
    w = torch.randn(24, 32, generator=torch.Generator().manual_seed(3))
    eye = torch.eye(32)
    up_w, down_w = fit_lowrank(w, 5, whiten=whitening_factor(eye))  # C = sqrt(1.01) I: the same subspace
    up_s, down_s = fit_lowrank(w, 5)
    torch.testing.assert_close(up_w @ down_w, up_s @ down_s, rtol=1e-4, atol=1e-4)


def test_whitening_factor_keeps_dead_inputs_defined_and_refuses_non_square() -> None:
    h = torch.zeros(6, 6)
    h[:3, :3] = torch.eye(3) * 4
    c = whitening_factor(h)
    assert torch.isfinite(c).all() and torch.allclose(c, torch.tril(c))
    with pytest.raises(QuantizationInputError, match="square"):
        whitening_factor(torch.zeros(3, 4))


@pytest.mark.parametrize("group", [64, 0])
def test_refined_decomposition_never_has_a_larger_output_error(group: int) -> None:
    x = _inputs(1024, 256, seed=4)
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(8)) / 16
    h = x.t() @ x
    c = whitening_factor(h)

    def error(q) -> float:  # noqa: ANN001 - an SVDQuantWeight
        return output_error(q.effective_weight() - w, c)

    first = decompose(w, rank=16, group_size=group, hessian=h)
    refined = decompose(w, rank=16, group_size=group, hessian=h, refine=3)
    whitened = decompose(w, rank=16, group_size=group, hessian=h, lowrank_fit="whitened", refine=3)
    assert error(refined) <= error(first) * (1 + 1e-6)
    assert error(whitened) <= error(decompose(w, rank=16, group_size=group, hessian=h, lowrank_fit="whitened"))
    # the artifact format is unchanged: the reference Linear runs it
    y = w4a8_linear_reference(x[:8], whitened)
    assert y.shape == (8, 96) and torch.isfinite(y).all()


def test_the_default_split_is_unchanged_by_the_new_settings() -> None:
    x = _inputs(512, 128, seed=1)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2))
    a = decompose(w, rank=8, group_size=64, act_absmax=x.abs().amax(0), hessian=x.t() @ x)
    b = decompose(w, rank=8, group_size=64, act_absmax=x.abs().amax(0), hessian=x.t() @ x, rounding="gptq",
                  lowrank_fit="svd", refine=0)
    for name, tensor in a.tensors().items():
        assert torch.equal(tensor, b.tensors()[name]), name


@pytest.mark.parametrize("kwargs,match", [
    ({"lowrank_fit": "whitened"}, "second moments"),
    ({"refine": 2}, "second moments"),
    ({"lowrank_fit": "qr", "hessian": True}, "lowrank_fit must be one of"),
    ({"refine": MAX_REFINE + 1, "hessian": True}, "refine must be an integer"),
    ({"refine": True, "hessian": True}, "refine must be an integer"),
    ({"refine": 1, "hessian": True, "rank": 0}, "needs a low-rank branch"),
    ({"rounding": "gptq"}, "gptq needs"),
])
def test_bad_fit_settings_are_refused(kwargs: dict, match: str) -> None:
    w = torch.randn(16, 64)
    kw = {"rank": 4, **kwargs}
    if kw.pop("hessian", False):
        kw["hessian"] = torch.eye(64)
    with pytest.raises(QuantizationInputError, match=match):
        decompose(w, group_size=64, **kw)


def test_calibration_records_the_fit_and_collects_moments_for_it(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    selected = select_for_calibration(model, ["0", "2"])
    with InputAbsmaxObserver(selected) as plain:
        model(torch.randn(10, 64))
    with pytest.raises(InvalidRequestError, match="second moments"):
        build_svdquant_artifact(model, selected, plain.absmax, rank=8, group_size=64, observer=plain, refine=1)
    with pytest.raises(InvalidRequestError, match="--lowrank-fit must be one of"):
        build_svdquant_artifact(model, selected, plain.absmax, rank=8, group_size=64, observer=plain,
                                lowrank_fit="qr")
    with pytest.raises(InvalidRequestError, match="--refine must be an integer"):
        build_svdquant_artifact(model, selected, plain.absmax, rank=8, group_size=64, observer=plain, refine=-1)
    with InputAbsmaxObserver(selected, second_moments=True) as obs:
        model(torch.randn(40, 64))
    manifest, tensors = build_svdquant_artifact(model, selected, obs.absmax, rank=8, group_size=64, observer=obs,
                                                include=["0", "2"], lowrank_fit="whitened", refine=2)
    assert manifest["calibration"]["lowrank_fit"] == "whitened" and manifest["calibration"]["refine"] == 2
    assert manifest["calibration"]["rounding"] == "nearest"
    art = load_svdquant_artifact(save_svdquant_artifact(manifest, tensors, tmp_path / "w.json"))
    assert set(art.linears) == {"0", "2"}
