"""Block fusion on the GPU: bitwise to eager at the standard workloads (random seeded weights, bf16).

* W17: the whole Wan2.1-1.3B architecture (30 blocks), latent 1x16x5x40x72 (3,600 tokens), text 512 x 4096;
* W81: two Wan2.1-1.3B blocks at latent 21x60x104 (32,760 tokens);
* SANA-Video 480p: two blocks of the default SANA-Video config at latent 21x60x104 (32,760 tokens).

Skipped without CUDA and triton.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worldfoundry import testing
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE
from worldfoundry.core.model_loading.dtypes import apply_dtype_policy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and TRITON_AVAILABLE), reason="needs CUDA + triton")]
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def _wan(layers: int) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    model = testing.seeded_model(WanTransformer3DModel, 0, device="cuda", **{**WAN_1_3B, "num_layers": layers})
    return apply_dtype_policy(model, torch.bfloat16).eval()


def _check(model: torch.nn.Module, name: str, inputs: dict[str, Any], registry: Any, blocks: int,
           options: dict[str, Any] | None = None) -> dict[str, Any]:
    with torch.inference_mode():
        dense = model(**inputs)[0]
        session = install_diffusion_accelerations(model, {name: options or {}}, registry=registry)
        with request_scope(RequestContext("gpu")):
            fused = model(**inputs)[0]
        record = session.execution_report()["plugins"][name]["model"]["requests"]["gpu"]
        session.uninstall()
        again = model(**inputs)[0]
    assert torch.equal(fused, dense), (fused.float() - dense.float()).abs().max().item()
    assert torch.equal(again, dense)
    assert record["claimed_not_executed"] == []
    assert record["counters"]["modulate"] == 2 * blocks
    return record


def _registry() -> Any:
    from worldfoundry_block_fusion import sana_plugin, wan_plugin

    from worldfoundry.core.acceleration.registry import AccelerationRegistry

    reg = AccelerationRegistry(discover=False)
    reg.register("wan_block_fusion", wan_plugin.prepare)
    reg.register("sana_block_fusion", sana_plugin.prepare)
    return reg


def _wan_inputs(frames: int, height: int, width: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, frames, height, width, device="cuda", generator=g).bfloat16(),
            "timestep": torch.tensor([500], device="cuda"),
            "encoder_hidden_states": torch.randn(1, 512, 4096, device="cuda", generator=g).bfloat16(),
            "return_dict": False}


def test_w17_whole_model_bitwise() -> None:
    """The default chains: the LayerNorms and the Q/K RMSNorms inside the kernels."""
    record = _check(_wan(30), "wan_block_fusion", _wan_inputs(5, 40, 72), _registry(), 30)
    assert record["fallbacks"] == {} and record["counters"]["rope"] == 30 and record["counters"]["qk_norm"] == 30
    assert record["counters"]["layer_norm"] == 3 * 30 and not record["counters"].get("float_carry")


def test_w17_whole_model_bitwise_with_torch_layer_norms_and_the_float_carry() -> None:
    chains = ["modulate", "gated_residual", "cross_residual", "rope", "qk_norm", "float_carry"]
    record = _check(_wan(30), "wan_block_fusion", _wan_inputs(5, 40, 72), _registry(), 30, {"chains": chains})
    assert record["fallbacks"] == {} and record["counters"]["rope"] == 30
    assert record["counters"]["float_carry"] == 2 * 30 + 29


def test_w81_two_blocks_bitwise() -> None:
    record = _check(_wan(2), "wan_block_fusion", _wan_inputs(21, 60, 104), _registry(), 2)
    assert record["fallbacks"] == {}


@pytest.mark.parametrize("workload,blocks", [((5, 40, 72), 30), ((21, 60, 104), 2)])
def test_layer_norm_chain_bitwise_to_pytorchs_cuda_layer_norm(workload: tuple[int, int, int], blocks: int) -> None:
    chains = ["modulate", "gated_residual", "cross_residual", "rope", "layer_norm"]
    record = _check(_wan(blocks), "wan_block_fusion", _wan_inputs(*workload), _registry(), blocks,
                    {"chains": chains})
    assert record["fallbacks"] == {} and record["counters"]["layer_norm"] == 3 * blocks


def test_sana_video_480p_two_blocks_bitwise() -> None:
    from diffusers import SanaVideoTransformer3DModel

    model = testing.seeded_model(SanaVideoTransformer3DModel, 0, device="cuda", num_layers=2)
    model = apply_dtype_policy(model, torch.bfloat16).eval()
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = {"hidden_states": torch.randn(1, 16, 21, 60, 104, device="cuda", generator=g).bfloat16(),
              "timestep": torch.tensor([500], device="cuda"),
              "encoder_hidden_states": torch.randn(1, 300, 2304, device="cuda", generator=g).bfloat16(),
              "return_dict": False}
    record = _check(model, "sana_block_fusion", inputs, _registry(), 2)
    assert record["counters"]["linear_attention"] == 2
    assert record["counters"]["glu"] == 2  # the feed-forward's gated SiLU, at 2 x 5,600 channels x 32,760 tokens
    assert not any(reason.startswith("glu") for reason in record["fallbacks"])


def test_background_compilation_runs_the_original_blocks_first_and_the_kernels_once_ready() -> None:
    """``kernel_compile: background`` with the real compiler: bitwise on every call, fused once ready."""
    from worldfoundry_block_fusion.kernel_warmup import REASON_COMPILING

    model = _wan(2)
    inputs = _wan_inputs(5, 40, 72)
    with torch.inference_mode():
        dense = model(**inputs)[0]
        session = install_diffusion_accelerations(model, {"wan_block_fusion": {"kernel_compile": "background"}},
                                                  registry=_registry())
        with request_scope(RequestContext("first")):
            first = model(**inputs)[0]
        assert session.wait_ready(120)
        with request_scope(RequestContext("ready")):
            ready = model(**inputs)[0]
        report = session.execution_report()["plugins"]["wan_block_fusion"]["model"]
        session.uninstall()
    assert torch.equal(first, dense) and torch.equal(ready, dense)
    assert set(report["requests"]["first"]["fallbacks"]) <= {REASON_COMPILING}  # the kernels may be cached already
    assert report["requests"]["ready"]["fallbacks"] == {} and report["requests"]["ready"]["counters"]["modulate"] == 4
    assert report["kernel_compile"] == "background" and report["kernels_pending"] is False
