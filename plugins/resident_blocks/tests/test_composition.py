"""resident_blocks under an attention adapter that patches projection forwards inside the blocks.

The adapter reads each projection's weight through its module at call time; resident_blocks keeps the
parameter objects and sub-module forwards in place, so the adapted output is bitwise the same with the blocks
offloaded (resident or streamed)."""

from __future__ import annotations

import pytest
import torch

from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.registry import AccelerationRegistry


@pytest.fixture
def both() -> AccelerationRegistry:
    registry = AccelerationRegistry(discover=True, allowlist={"resident_blocks", "attention_lora"})
    if "attention_lora" not in registry.names() or "resident_blocks" not in registry.names():
        pytest.skip("the attention_lora and resident_blocks distributions are not both installed")
    return registry


def _adapter(tmp_path, model, rank: int = 4) -> str:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    state = {}
    for i in range(len(model.blocks)):
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v", "to_out.0"):
                linear = model.get_submodule(f"blocks.{i}.{attn}.{proj}")
                key = f"blocks.{i}.{attn}.{proj}"
                state[f"{key}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=g) * 0.1
                state[f"{key}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=g) * 0.1
    path = tmp_path / "adapter.safetensors"
    save_file(state, str(path))
    return str(path)


@pytest.mark.parametrize("r", [0, 2])
def test_attention_adapter_runs_bitwise_under_resident_blocks(tiny, both, tmp_path, r: int) -> None:
    model = tiny.make_tiny_wan()
    dense = tiny.wan_forward(model)
    lora = {"attention_lora": {"path": _adapter(tmp_path, model), "rank": 4, "scale": 0.5}}
    session = install_diffusion_accelerations(model, lora, registry=both)
    adapted = tiny.wan_forward(model)
    session.uninstall()
    assert not torch.equal(adapted, dense)  # the adapter changes the output

    spec = {**lora, "resident_blocks": {"offload_resident_blocks": r, "cpu_offload_block_contiguous": True}}
    session = install_diffusion_accelerations(model, spec, registry=both)
    for out in tiny.run_request(model, "lora", steps=2):
        assert torch.equal(out, adapted)
    record = session.execution_report()["plugins"]
    assert record["resident_blocks"]["model"]["requests"]["lora"]["counters"]["transfers"] == 4 * (tiny.N - r)
    assert any(k.startswith("blocks.3.attn1") for k in record["attention_lora"]["model"]["requests"]["lora"]["modules"])
    session.uninstall()
    assert torch.equal(tiny.wan_forward(model), dense)
