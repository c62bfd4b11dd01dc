"""Packed storages: original Parameters become views (no added memory), unpack restores separate copies."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from worldfoundry.core.attention.packed_storage import (
    DerivedPackedLinear,
    PackedLinearParameters,
    PackedWeights,
    check_linears_packable,
    storage_owners,
)
from worldfoundry.errors import ParameterPackingError


class Attn(nn.Module):
    def __init__(self, dim: int = 16, bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.to_q = nn.Linear(dim, dim, bias=bias)
        self.to_k = nn.Linear(dim, dim, bias=bias)
        self.to_v = nn.Linear(dim, 24, bias=bias)


def _named(m: Attn) -> list[tuple[str, nn.Module]]:
    return [("to_q", m.to_q), ("to_k", m.to_k), ("to_v", m.to_v)]


def _storages(module: nn.Module) -> dict[int, int]:
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}


def test_pack_makes_the_original_parameters_views_of_one_storage() -> None:
    m = Attn()
    params = dict(m.named_parameters())
    state = {k: v.clone() for k, v in m.state_dict().items()}
    before = _storages(m)
    check_linears_packable(_named(m), owners=storage_owners(m))
    pack = PackedLinearParameters.pack([m.to_q, m.to_k, m.to_v])
    after = _storages(m)
    assert len(before) == 6 and len(after) == 2
    assert sum(after.values()) == sum(before.values())  # no weight memory added
    assert all(p is params[name] for name, p in m.named_parameters())
    assert list(m.state_dict()) == list(state)
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
    current = pack.current()
    assert isinstance(current, PackedWeights)
    assert current.weight.shape == (56, 16) and current.bias.shape == (56,)
    assert m.to_k.weight.data_ptr() == current.weight.data_ptr() + 16 * 16 * 4
    assert pack.nbytes == sum(before.values())


def test_in_place_edits_reach_the_packed_storage() -> None:
    m = Attn()
    pack = PackedLinearParameters.pack([m.to_q, m.to_k, m.to_v])
    m.load_state_dict({k: torch.full_like(v, 0.5) for k, v in m.state_dict().items()})
    current = pack.current()
    assert isinstance(current, PackedWeights)
    assert torch.all(current.weight == 0.5) and torch.all(current.bias == 0.5)


def test_unpack_restores_separate_identical_tensors() -> None:
    m = Attn()
    state = {k: v.clone() for k, v in m.state_dict().items()}
    params = dict(m.named_parameters())
    pack = PackedLinearParameters.pack([m.to_q, m.to_k, m.to_v])
    pack.unpack()
    pack.unpack()  # idempotent
    assert len(_storages(m)) == 6
    assert all(p is params[name] for name, p in m.named_parameters())
    assert all(p.storage_offset() == 0 and p.is_contiguous() for p in m.parameters())
    assert all(torch.equal(state[k], v) for k, v in m.state_dict().items())
    assert pack.current() == "unpacked"


def test_replaced_or_moved_parameters_are_detected() -> None:
    m = Attn()
    pack = PackedLinearParameters.pack([m.to_q, m.to_k, m.to_v])
    m.to_v.weight = nn.Parameter(m.to_v.weight.detach().clone())
    assert pack.current() == "parameter_replaced"
    m2 = Attn()
    pack2 = PackedLinearParameters.pack([m2.to_q, m2.to_k, m2.to_v])
    m2.to(torch.float64)
    assert pack2.current() == "storage_changed"
    pack2.unpack()  # parameters no longer in the packed storage are left alone
    assert m2.to_q.weight.dtype == torch.float64


def test_no_bias_packs_weights_only() -> None:
    m = Attn(bias=False)
    pack = PackedLinearParameters.pack([m.to_q, m.to_k, m.to_v])
    current = pack.current()
    assert isinstance(current, PackedWeights) and current.bias is None
    assert len(_storages(m)) == 1


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_q = nn.Linear(8, 8)
        self.to_k = nn.Linear(8, 8)
        self.to_v = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8)
        self.other.weight = self.to_k.weight


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: setattr(m.to_k, "weight", m.to_q.weight), "tied|shares its storage|same Parameter"),
        (lambda m: m.to_v.to(torch.float64), "float64 on cpu but"),
        (lambda m: setattr(m.to_v, "weight", nn.Parameter(torch.zeros(16, 16, dtype=torch.int8),
                                                          requires_grad=False)), "dtype torch.int8"),
        (lambda m: setattr(m.to_v, "bias", None), "differ in having a bias"),
        (lambda m: setattr(m, "to_v", nn.Linear(8, 16)), "reads 8 features"),
        (lambda m: setattr(m, "to_v", nn.Identity()), "not a plain torch.nn.Linear"),
        (lambda m: setattr(m.to_v, "weight", nn.Parameter(torch.zeros(32, 16)[:16])), "view into a larger storage"),
        (lambda m: m.register_buffer("alias", m.to_q.bias), "shares its storage"),
    ],
)
def test_unpackable_groups_are_refused(mutate, message: str) -> None:  # noqa: ANN001
    m = Attn()
    mutate(m)
    with pytest.raises(ParameterPackingError, match=message):
        check_linears_packable(_named(m), owners=storage_owners(m))


def test_tied_with_a_module_outside_the_group_is_refused() -> None:
    m = Tied()
    with pytest.raises(ParameterPackingError, match="other.weight"):
        check_linears_packable([("to_q", m.to_q), ("to_k", m.to_k), ("to_v", m.to_v)], owners=storage_owners(m))
    # a derived copy does not share storage, so ties do not matter there
    check_linears_packable([("to_q", m.to_q), ("to_k", m.to_k)], share_storage=False)


def test_parameter_subclass_and_meta_are_refused() -> None:
    class QuantParam(nn.Parameter):
        pass

    m = Attn()
    m.to_k.weight = QuantParam(torch.zeros(16, 16))
    with pytest.raises(ParameterPackingError, match="not a plain nn.Parameter"):
        check_linears_packable(_named(m), share_storage=False)
    with torch.device("meta"):
        meta = Attn()
    with pytest.raises(ParameterPackingError, match="meta"):
        check_linears_packable(_named(meta), share_storage=False)
    with pytest.raises(ParameterPackingError, match="at least two"):
        check_linears_packable(_named(Attn())[:1])


def test_derived_copy_follows_its_sources() -> None:
    m = Attn()
    derived = DerivedPackedLinear([m.to_k, m.to_v])
    first = derived.current()
    assert derived.builds == 1 and derived.current() is first  # unchanged sources: no rebuild
    assert torch.equal(first.weight, torch.cat([m.to_k.weight, m.to_v.weight]))
    with torch.no_grad():
        m.to_k.weight.add_(1.0)  # in place: version counter
    second = derived.current()
    assert derived.builds == 2 and torch.equal(second.weight[:16], m.to_k.weight)
    m.to_v.bias = nn.Parameter(torch.ones(24))  # assignment: identity
    assert torch.equal(derived.current().bias[16:], torch.ones(24)) and derived.builds == 3
    m.to(torch.float64)  # cast: pointer and dtype
    assert derived.current().weight.dtype == torch.float64 and derived.builds == 4
    m.to_k.weight.data.mul_(0.0)  # raw .data write: not seen (documented: reinstall)
    assert derived.current().weight.abs().sum() > 0 and derived.builds == 4
    derived.release()
    assert derived.nbytes == 0
