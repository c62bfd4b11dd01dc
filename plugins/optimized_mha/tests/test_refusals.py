"""Options validation, refusals (each named) and lifecycle rules of optimized_mha."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from worldfoundry_optimized_mha.options import Options

from worldfoundry.core.acceleration.guard import attach_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.errors import (
    AccelerationOptionsError,
    AccelerationRefusedError,
    ModelBusyError,
)

# ---------------------------------------------------------------------------------------------- options


def test_defaults_and_partial_specs() -> None:
    both = Options.from_mapping({})
    assert both.defaults and both.exact
    assert both.to_json() == {"self": {"fusion": "qkv", "sdpa_backend": "torch"},
                              "cross": {"fusion": "kv", "sdpa_backend": "torch"}}
    only_self = Options.from_mapping({"self": {}})
    assert only_self.cross_attention is None and not only_self.defaults
    cudnn = Options.from_mapping({"cross": {"fusion": "none", "sdpa_backend": "cudnn"}})
    assert not cudnn.exact and [k.kind for k in cudnn.kinds()] == ["cross"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"selff": {}}, r"unknown option\(s\) \['selff'\]"),
        ({"self": {"fusion": "qkv", "backend": "flash"}}, r"unknown option\(s\) \['backend'\] in 'self'"),
        ({"self": {"fusion": "kv"}}, r"self.fusion must be one of \['qkv', 'none'\]"),
        ({"cross": {"fusion": "qkv"}}, r"cross.fusion must be one of \['kv', 'none'\]"),
        ({"self": {"sdpa_backend": "flash3"}}, "self.sdpa_backend must be one of"),
        ({"self": {"sdpa_backend": 1}}, "must be a string"),
        ({"self": "qkv"}, "'self' must be a mapping"),
        ({"self": {"fusion": "none"}}, "nothing selected"),
        ({"self": {"fusion": "none"}, "cross": {"fusion": "none", "sdpa_backend": "torch"}}, "nothing selected"),
    ],
)
def test_invalid_options_are_named(options: dict, message: str) -> None:
    with pytest.raises(AccelerationOptionsError, match=message):
        Options.from_mapping(options)


def test_options_must_be_a_mapping() -> None:
    with pytest.raises(AccelerationOptionsError, match="must be a mapping"):
        Options.from_mapping(["self"])  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- refusals


def _refused(case, registry, match: str, spec: dict | None = None) -> None:  # noqa: ANN001
    state = {k: v.clone() for k, v in case.model.state_dict().items()}
    with pytest.raises(AccelerationRefusedError, match=match):
        install_diffusion_accelerations(case.model, {"optimized_mha": spec or {}}, registry=registry)
    assert all(torch.equal(state[k], v) for k, v in case.model.state_dict().items())
    assert "_worldfoundry_accelerations" not in case.model.__dict__


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's inductor import on .compile()
def test_refuses_compiled_models(wan_case, registry) -> None:  # noqa: ANN001
    wan_case.model.blocks[0].compile()
    _refused(wan_case, registry, "compiled with torch.compile")


def test_refuses_cuda_graph_captured_models(wan_case, registry) -> None:  # noqa: ANN001
    wan_case.model._worldfoundry_cuda_graph = True
    _refused(wan_case, registry, "CUDA graph")


def test_refuses_sequence_parallel_models(wan_case, registry) -> None:  # noqa: ANN001
    wan_case.model.blocks[0].attn1.processor._parallel_config = object()
    _refused(wan_case, registry, "context parallelism is enabled on blocks.0.attn1")


def test_refuses_training_mode(wan_case, registry) -> None:  # noqa: ANN001
    wan_case.model.train()
    _refused(wan_case, registry, "training mode")


def test_refuses_hooks_on_projections(wan_case, registry) -> None:  # noqa: ANN001
    wan_case.model.blocks[1].attn1.to_v.register_forward_hook(lambda m, i, o: None)
    _refused(wan_case, registry, "blocks.1.attn1.to_v has forward hooks")


def test_refuses_unknown_processors(wan_case, registry) -> None:  # noqa: ANN001
    class CustomProcessor(WanAttnProcessor):
        pass

    wan_case.model.blocks[0].attn2.set_processor(CustomProcessor())
    _refused(wan_case, registry, "blocks.0.attn2 uses attention processor CustomProcessor")
    # the self-attention alone is still fine
    install_diffusion_accelerations(wan_case.model, {"optimized_mha": {"self": {}}}, registry=registry).uninstall()


def test_refuses_diffusers_fused_projections(wan_case, registry) -> None:  # noqa: ANN001
    wan_case.model.fuse_qkv_projections()
    _refused(wan_case, registry, "unfuse_qkv_projections")


def test_refuses_tied_parameters(wan_case, registry) -> None:  # noqa: ANN001
    blocks = wan_case.model.blocks
    blocks[1].attn1.to_q.weight = blocks[0].attn1.to_q.weight
    _refused(wan_case, registry, "cannot pack qkv of blocks.0.attn1 into one storage: .*shares its storage")


def test_refuses_quantized_or_non_float_weights(wan_case, registry) -> None:  # noqa: ANN001
    lin = wan_case.model.blocks[0].attn1.to_v
    lin.weight = nn.Parameter(torch.zeros_like(lin.weight, dtype=torch.int8), requires_grad=False)
    _refused(wan_case, registry, "dtype torch.int8")


def test_refuses_mixed_dtypes(wan_case, registry) -> None:  # noqa: ANN001
    wan_case.model.blocks[0].attn2.to_v.to(torch.bfloat16)
    _refused(wan_case, registry, "one dtype and device", {"cross": {}})


def test_refuses_a_kind_the_model_lacks(builders, registry) -> None:  # noqa: ANN001
    case = builders["h3"]()
    _refused(case, registry, "has no cross-attention", {"cross": {}})
    # the defaults skip it
    session = install_diffusion_accelerations(case.model, {"optimized_mha": True}, registry=registry)
    assert all(".attn." in c for c in session.receipt.plugins[0].claims)
    session.uninstall()


def test_refuses_other_model_classes(registry) -> None:  # noqa: ANN001
    with pytest.raises(AccelerationRefusedError, match="not a supported DiT"):
        install_diffusion_accelerations(nn.Linear(2, 2), {"optimized_mha": {}}, registry=registry)


def test_install_is_refused_while_busy(wan_case, registry) -> None:  # noqa: ANN001
    guard = attach_request_guard(wan_case.model)
    guard.begin_request("r1")
    with pytest.raises(ModelBusyError, match="'r1'"):
        install_diffusion_accelerations(wan_case.model, {"optimized_mha": {}}, registry=registry)
    session_free = wan_case.model.__dict__.get("_worldfoundry_accelerations")
    assert session_free is None
    guard.end_request("r1")
    session = install_diffusion_accelerations(wan_case.model, {"optimized_mha": {}}, registry=registry)
    guard.begin_request("r2")
    with pytest.raises(ModelBusyError):
        session.uninstall()
    guard.end_request("r2")
    session.uninstall()


def test_declares_offload_incompatible(wan_case, registry) -> None:  # noqa: ANN001
    from worldfoundry.core.acceleration.prepared import ROLE_OFFLOAD, PreparedAcceleration
    from worldfoundry.errors import AccelerationConflictError

    registry.register("offloader", lambda model, options, policy: PreparedAcceleration(
        name="offloader", claims=frozenset({ROLE_OFFLOAD}), activate=lambda: None))
    with pytest.raises(AccelerationConflictError, match="role:offload"):
        install_diffusion_accelerations(wan_case.model, {"optimized_mha": {}, "offloader": {}}, registry=registry)


def test_entry_point_registers_the_plugin() -> None:
    import importlib.metadata

    try:
        importlib.metadata.distribution("worldfoundry-optimized-mha")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the distribution is not installed")
    registry = AccelerationRegistry(allowlist=["optimized_mha"])
    assert registry.get("optimized_mha").distribution == "worldfoundry-optimized-mha"
