"""The exact plugins on diffusers pipelines on a CUDA device (bf16): bitwise to vanilla, before and after."""

from __future__ import annotations

import pytest
import torch
from conftest import EXACT_SPECS, applicable, spec_for
from pipelines import BUILDERS

import worldfoundry

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("plugin", sorted(EXACT_SPECS))
@pytest.mark.parametrize("kind", ["wan_t2v", "wan22", "sana_video"])
def test_exact_plugin_is_bitwise_on_cuda_bf16(kind, plugin):
    if not applicable(plugin, kind):
        pytest.skip(f"{plugin} is for Wan models")
    tiny = BUILDERS[kind]()
    tiny.pipe.to("cuda", torch.bfloat16)
    kwargs = {k: (v.to("cuda", torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point()
                  else v.to("cuda") if isinstance(v, torch.Tensor) else v) for k, v in tiny.call_kwargs.items()}
    tiny.call_kwargs = kwargs

    def run() -> torch.Tensor:
        return tiny.run(generator=torch.Generator("cuda").manual_seed(0))

    vanilla = run()
    accel = worldfoundry.accelerate(tiny.pipe, spec_for(plugin, kind))
    assert torch.equal(run(), vanilla)
    assert accel.last_call.outcome == "completed" and plugin in accel.last_call.plugins
    accel.uninstall()
    assert torch.equal(run(), vanilla)
