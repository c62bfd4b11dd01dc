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


def _cuda_kwargs(tiny) -> None:
    tiny.call_kwargs = {k: (v.to("cuda", torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point()
                            else v.to("cuda") if isinstance(v, torch.Tensor) else v)
                        for k, v in tiny.call_kwargs.items()}


@pytest.mark.parametrize("order", ["offload_first", "plugin_first"])
@pytest.mark.parametrize("plugin", sorted(EXACT_SPECS))
def test_exact_plugin_next_to_model_cpu_offload(plugin, order):
    """``enable_model_cpu_offload`` (accelerate hooks move each component to CUDA for its call) next to each exact
    plugin, in both orders: bitwise equal to vanilla diffusers with the same offload, or refused naming both sides;
    never a failure deferred to a later call."""
    from worldfoundry.errors import WorldFoundryError

    tiny = BUILDERS["wan_t2v"]()
    tiny.pipe.to(torch.bfloat16)
    _cuda_kwargs(tiny)

    def run() -> torch.Tensor:
        return tiny.run(generator=torch.Generator("cuda").manual_seed(0))

    tiny.pipe.enable_model_cpu_offload()
    vanilla = run()
    if order == "offload_first":
        try:
            accel = worldfoundry.accelerate(tiny.pipe, spec_for(plugin, "wan_t2v"))
        except WorldFoundryError as exc:  # refused at install: the message names the offload hook and the plugin
            assert plugin in str(exc) and ("accelerate" in str(exc) or "offload" in str(exc)), str(exc)
            assert torch.equal(run(), vanilla)
            return
        assert torch.equal(run(), vanilla)
        assert accel.last_call.outcome == "completed" and plugin in accel.last_call.plugins
        accel.uninstall()
        assert torch.equal(run(), vanilla)
        return
    tiny.pipe.remove_all_hooks()
    tiny.pipe.to("cpu")
    accel = worldfoundry.accelerate(tiny.pipe, spec_for(plugin, "wan_t2v"))
    try:
        tiny.pipe.enable_model_cpu_offload()
    except WorldFoundryError as exc:  # refused at the call (the offload's move), naming the plugin and what to do
        assert plugin in str(exc) and "uninstall" in str(exc), str(exc)
        accel.uninstall()
        return
    assert torch.equal(run(), vanilla)
    accel.uninstall()
    assert torch.equal(run(), vanilla)
