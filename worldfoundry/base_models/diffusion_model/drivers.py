"""Family drivers: how each model family turns a request into model inputs and reads its output.

A driver validates the request against the model (frame count vs the codec's temporal stride, sizes vs
the spatial stride × patch), encodes the conditioning once per request (fixed over the steps), draws the
seeded initial noise, and builds the keyword arguments of each model call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from worldfoundry.base_models.diffusion_model.request import DiffusionRequest
from worldfoundry.errors import InvalidRequestError


@dataclass
class PreparedInputs:
    """Per request: the initial latents (fp32) and the per-branch conditioning that stays fixed over steps."""

    latents: torch.Tensor
    branches: dict[str, dict[str, Any]]
    extra: dict[str, Any] = field(default_factory=dict)


def seeded_noise(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """Gaussian noise drawn on the CPU (device independent), then moved."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device)


def _check_video_size(request: DiffusionRequest, temporal: int, spatial: int, patch: tuple[int, int, int]) -> None:
    frames, height, width = request.num_frames, request.height, request.width
    if (frames - 1) % temporal != 0:
        lo = (frames - 1) // temporal * temporal + 1
        raise InvalidRequestError(
            f"num_frames={frames}: the codec's temporal stride is {temporal}, so num_frames must be "
            f"{temporal}·k + 1 (e.g. {lo} or {lo + temporal})"
        )
    step = spatial * patch[1]
    for name, value in (("height", height), ("width", width)):
        if value % step != 0:
            raise InvalidRequestError(
                f"{name}={value}: must be divisible by {step} (codec stride {spatial} × patch {patch[1]}); "
                f"try {max(step, value // step * step)}"
            )


def encode_text(tokenizer: Any, text_encoder: Any, prompts: list[str], max_length: int, device: torch.device,
                dtype: torch.dtype, *, zero_padding: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize to ``max_length`` and run the encoder; padded positions are zeroed when ``zero_padding``."""
    inputs = tokenizer(prompts, padding="max_length", max_length=max_length, truncation=True,
                       add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    ids = inputs.input_ids.to(device)
    mask = inputs.attention_mask.to(device)
    with torch.no_grad():
        out = text_encoder(input_ids=ids, attention_mask=mask)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    if zero_padding:
        hidden = hidden * mask.unsqueeze(-1).to(hidden.dtype)
    return hidden.to(dtype), mask


class WanDriver:
    """Wan 2.1 / 2.2 (T2V, I2V with image K/V and latent condition, TI2V-5B with per-token timesteps)."""

    family = "wan"

    def __init__(self, components: Any) -> None:
        self.c = components
        self.model = components.denoiser.model
        self.patch = tuple(self.model.config.patch_size)
        codec = components.codec
        self.temporal = codec.temporal_stride if codec is not None else 4
        self.spatial = codec.spatial_stride if codec is not None else 8
        self.max_length = int(components.recipe.component("tokenizer").get("max_length", 512))
        self.expand_timesteps = bool(components.recipe.denoiser.get("expand_timesteps", False))
        self.mode = components.recipe.mode

    def validate(self, request: DiffusionRequest) -> None:
        _check_video_size(request, self.temporal, self.spatial, self.patch)
        if self.mode == "i2v" and request.image is None:
            raise InvalidRequestError("image: this recipe is image-to-video; pass DiffusionRequest(image=...)")

    def latent_shape(self, request: DiffusionRequest) -> tuple[int, ...]:
        channels = self.model.config.out_channels
        return (1, channels, (request.num_frames - 1) // self.temporal + 1, request.height // self.spatial,
                request.width // self.spatial)

    def prepare(self, request: DiffusionRequest, device: torch.device, dtype: torch.dtype, cfg: bool) -> PreparedInputs:
        prompts = {"cond": request.prompt}
        if cfg:
            prompts["uncond"] = request.negative_prompt or ""
        branches: dict[str, dict[str, Any]] = {}
        for branch, text in prompts.items():
            emb, _ = encode_text(self.c.tokenizer, self.c.text_encoder, [text], self.max_length, device, dtype,
                                 zero_padding=True)
            branches[branch] = {"encoder_hidden_states": emb}
        latents = seeded_noise(self.latent_shape(request), request.seed, device)
        extra: dict[str, Any] = {}
        if self.mode == "i2v":
            image_embeds, condition = self._image_condition(request, latents, device, dtype)
            for kwargs in branches.values():
                kwargs["encoder_hidden_states_image"] = image_embeds
            extra["condition"] = condition
        return PreparedInputs(latents, branches, extra)

    def _image_condition(self, request: DiffusionRequest, latents: torch.Tensor, device: torch.device,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        image = to_image_tensor(request.image, request.height, request.width)  # 1x3xHxW in [-1, 1]
        pixel = self.c.image_processor(images=((image[0].permute(1, 2, 0) + 1) * 127.5).round().clamp(0, 255)
                                       .to(torch.uint8).numpy(), return_tensors="pt").pixel_values
        with torch.no_grad():
            enc = self.c.image_encoder(pixel_values=pixel.to(device, self.c.image_encoder.dtype),
                                       output_hidden_states=True)
        image_embeds = enc.hidden_states[-2].to(dtype)
        frames = request.num_frames
        video = torch.cat([image.unsqueeze(2), image.new_zeros(1, 3, frames - 1, request.height, request.width)], 2)
        cond_latents = self.c.codec.encode(video.to(device)).to(torch.float32)
        _, _, t, h, w = latents.shape
        mask = torch.zeros(1, 1, frames, h, w, device=device)
        mask[:, :, 0] = 1
        first = mask[:, :, 0:1].repeat_interleave(self.temporal, dim=2)
        mask = torch.cat([first, mask[:, :, 1:]], dim=2).view(1, -1, self.temporal, h, w).transpose(1, 2)
        return image_embeds, torch.cat([mask, cond_latents], dim=1)

    def model_kwargs(self, prepared: PreparedInputs, latents: torch.Tensor, timestep: torch.Tensor, branch: str,
                     dtype: torch.dtype) -> dict[str, Any]:
        hidden = latents
        if "condition" in prepared.extra:
            hidden = torch.cat([latents, prepared.extra["condition"]], dim=1)
        if self.expand_timesteps:
            _, _, t, h, w = latents.shape
            tokens = t * (h // self.patch[1]) * (w // self.patch[2])
            ts = timestep.reshape(1, 1).expand(1, tokens)
        else:
            ts = timestep.reshape(1)
        return {"hidden_states": hidden.to(dtype), "timestep": ts, **prepared.branches[branch], "return_dict": False}

    @staticmethod
    def velocity_for(prepared: PreparedInputs, output: Any) -> torch.Tensor:
        return output[0].float()


class SanaVideoDriver(WanDriver):
    """SANA-Video: Gemma-style text encoder with an attention mask, Wan VAE latents."""

    family = "sana_video"

    def validate(self, request: DiffusionRequest) -> None:
        _check_video_size(request, self.temporal, self.spatial, self.patch)

    def prepare(self, request: DiffusionRequest, device: torch.device, dtype: torch.dtype, cfg: bool) -> PreparedInputs:
        prompts = {"cond": request.prompt}
        if cfg:
            prompts["uncond"] = request.negative_prompt or ""
        branches = {}
        for branch, text in prompts.items():
            emb, mask = encode_text(self.c.tokenizer, self.c.text_encoder, [text], self.max_length, device, dtype,
                                    zero_padding=False)
            branches[branch] = {"encoder_hidden_states": emb, "encoder_attention_mask": mask}
        return PreparedInputs(seeded_noise(self.latent_shape(request), request.seed, device), branches)

    def model_kwargs(self, prepared: PreparedInputs, latents: torch.Tensor, timestep: torch.Tensor, branch: str,
                     dtype: torch.dtype) -> dict[str, Any]:
        return {"hidden_states": latents.to(dtype), "timestep": timestep.reshape(1), **prepared.branches[branch],
                "return_dict": False}


def to_image_tensor(image: Any, height: int, width: int) -> torch.Tensor:
    """HxWx3 uint8 array / PIL image / 3xHxW tensor in [-1, 1] -> 1x3xHxW float tensor in [-1, 1] at the size."""
    if isinstance(image, torch.Tensor):
        tensor = image.float()
        if tensor.ndim == 3:
            tensor = tensor.unsqueeze(0)
    else:
        array = np.asarray(image)
        if array.ndim != 3 or array.shape[-1] != 3:
            raise InvalidRequestError(f"image: expected an HxWx3 array, got shape {array.shape}")
        tensor = torch.from_numpy(array.astype(np.float32) / 127.5 - 1.0).permute(2, 0, 1).unsqueeze(0)
    if tensor.ndim != 4 or tensor.shape[1] != 3:
        raise InvalidRequestError(f"image: expected 3 channels, got shape {tuple(tensor.shape)}")
    if tensor.shape[-2:] != (height, width):
        tensor = torch.nn.functional.interpolate(tensor, size=(height, width), mode="bilinear", align_corners=False)
    return tensor.clamp(-1, 1)


def driver_for(components: Any) -> Any:
    family = components.recipe.family
    if family == "wan":
        return WanDriver(components)
    if family == "sana_video":
        return SanaVideoDriver(components)
    if family == "minimax_h3":
        from worldfoundry.base_models.diffusion_model.h3_session import H3Driver

        return H3Driver(components)
    raise InvalidRequestError(f"no driver for family {family!r}")


def guidance_for(request: DiffusionRequest, expert_index: int) -> float:
    scale = float(request.guidance_scale if request.guidance_scale is not None else 1.0)
    if expert_index > 0 and request.guidance_scale_2 is not None:
        return float(request.guidance_scale_2)
    return scale

