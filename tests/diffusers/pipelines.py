"""Tiny diffusers pipelines built from seeded components on the CPU (no hub, no network).

Each builder returns a :class:`TinyPipeline`: the diffusers pipeline itself and a ``run()`` calling it the way a
user does (precomputed prompt embeddings stand in for the text encoder; the output is the latent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from worldfoundry import testing

WAN = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=16, freq_dim=16,
           ffn_dim=32, num_layers=2, rope_max_seq_len=32)
TEXT_TOKENS = 6
STEPS = 4


def wan_transformer(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny Wan transformer of :data:`WAN` (``overrides`` applied), every weight drawn from ``seed``."""
    return testing.tiny_wan(seed, weight_seed=seed, **{**WAN, **overrides})


def _embeds(dim: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, TEXT_TOKENS, dim, generator=g), torch.randn(1, TEXT_TOKENS, dim, generator=g)


@dataclass
class TinyPipeline:
    pipe: Any
    call_kwargs: dict[str, Any]
    kind: str
    dits: tuple[str, ...] = ("transformer",)
    extra: dict[str, Any] = field(default_factory=dict)

    def run(self, **overrides: Any) -> torch.Tensor:
        kwargs = {**self.call_kwargs, "generator": torch.Generator().manual_seed(0), **overrides}
        out = self.pipe(**kwargs)
        return out.frames if hasattr(out, "frames") else out[0]

    def transformers(self) -> list[torch.nn.Module]:
        return [getattr(self.pipe, name) for name in self.dits]


def wan_t2v(seed: int = 0, *, steps: int = STEPS, guidance_scale: float = 5.0) -> TinyPipeline:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    transformer = wan_transformer(seed)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=None,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    pe, ne = _embeds(WAN["text_dim"])
    kwargs = dict(prompt_embeds=pe, negative_prompt_embeds=ne, height=16, width=16, num_frames=5,
                  num_inference_steps=steps, guidance_scale=guidance_scale, output_type="latent")
    return TinyPipeline(pipe, kwargs, "wan_t2v")


def wan22(seed: int = 0, *, steps: int = 6, boundary_ratio: float = 0.875) -> TinyPipeline:
    """Wan 2.2 A14B layout: two experts routed by ``boundary_ratio`` (both phases non-empty at 6 steps)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    high, low = wan_transformer(seed), wan_transformer(seed + 1)
    pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=high, transformer_2=low, vae=None,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), boundary_ratio=boundary_ratio)
    pipe.set_progress_bar_config(disable=True)
    pe, ne = _embeds(WAN["text_dim"])
    kwargs = dict(prompt_embeds=pe, negative_prompt_embeds=ne, height=16, width=16, num_frames=5,
                  num_inference_steps=steps, guidance_scale=5.0, guidance_scale_2=3.0, output_type="latent")
    return TinyPipeline(pipe, kwargs, "wan22", ("transformer", "transformer_2"))


def wan_i2v(seed: int = 0, *, steps: int = STEPS) -> TinyPipeline:
    """Wan 2.1 I2V layout: image K/V in cross-attention, the first frame encoded by a tiny Wan VAE."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    z = 4
    transformer = wan_transformer(seed, in_channels=2 * z + 4, out_channels=z, image_dim=24, added_kv_proj_dim=32)
    torch.manual_seed(seed + 7)
    vae = AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * z,
                           latents_std=[1.0] * z).eval()
    torch.manual_seed(seed + 11)
    encoder = CLIPVisionModel(CLIPVisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=32, patch_size=8)).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, image_encoder=encoder, image_processor=processor,
                                   transformer=transformer, vae=vae,
                                   scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    pe, ne = _embeds(WAN["text_dim"])
    g = torch.Generator().manual_seed(5)
    image = Image.fromarray((torch.rand(16, 16, 3, generator=g) * 255).to(torch.uint8).numpy())
    kwargs = dict(image=image, prompt_embeds=pe, negative_prompt_embeds=ne,
                  height=16, width=16, num_frames=5,
                  num_inference_steps=steps, guidance_scale=5.0, output_type="latent")
    return TinyPipeline(pipe, kwargs, "wan_i2v")


def sana_video(seed: int = 0, *, steps: int = STEPS) -> TinyPipeline:
    """SANA-Video: CFG batched into one forward (no ``cache_context``), linear self-attention."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaVideoPipeline

    transformer = testing.tiny_sana_video(
        seed, weight_scale=0.05, weight_seed=seed,
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=16,
        mlp_ratio=2.5, patch_size=(1, 2, 2), sample_size=8, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )
    pipe = SanaVideoPipeline(tokenizer=None, text_encoder=None, transformer=transformer, vae=None,
                             scheduler=FlowMatchEulerDiscreteScheduler(shift=8.0))
    pipe.set_progress_bar_config(disable=True)
    pe, ne = _embeds(16)
    mask = torch.ones(1, TEXT_TOKENS, dtype=torch.long)
    kwargs = dict(prompt_embeds=pe, prompt_attention_mask=mask, negative_prompt=None, negative_prompt_embeds=ne,
                  negative_prompt_attention_mask=mask, height=32, width=32, frames=5,
                  num_inference_steps=steps, guidance_scale=4.5, output_type="latent",
                  use_resolution_binning=False)
    return TinyPipeline(pipe, kwargs, "sana_video")


BUILDERS: dict[str, Callable[..., TinyPipeline]] = {
    "wan_t2v": wan_t2v, "wan22": wan22, "wan_i2v": wan_i2v, "sana_video": sana_video,
}
