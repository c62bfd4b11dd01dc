"""``DiffusionRequest`` (what to generate) and ``DiffusionResult`` (what came out, with receipts and timings)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from worldfoundry.errors import InvalidRequestError

OUTPUT_TYPES = ("latent", "np", "mp4")


@dataclass(frozen=True)
class DiffusionRequest:
    """One generation request. ``None`` fields take the recipe's defaults.

    Args:
        prompt: the text prompt (unused for MiniMax-H3 bundles, whose text embeddings are precomputed).
        negative_prompt: text for the unconditional CFG branch (recipe default when ``None``).
        num_frames / height / width: output video size; validated against the codec's strides.
        num_inference_steps: denoising steps (> 0).
        guidance_scale: CFG scale; ``<= 1`` runs the conditional branch only.
        guidance_scale_2: CFG scale of the low-noise expert (Wan2.2 A14B); defaults to ``guidance_scale``.
        flow_shift: scheduler shift override.
        seed: seeds the initial noise (drawn on the CPU, so it is device independent).
        request_id: explicit id (a fresh one is generated when ``None``).
        output_type: ``"latent"``, ``"np"`` (uint8 frames) or ``"mp4"`` (also writes ``output_path``).
        image: first frame for image-to-video recipes (HxWx3 uint8 array or 3xHxW float tensor in [-1, 1]).
        bundle: MiniMax-H3 conditioning bundle (directory path or a loaded ``H3Bundle``).
        output_path: where ``output_type="mp4"`` writes the video.
        fps: frames per second of the MP4.
        progress: show a progress bar (policy option ``progress`` when ``None``).
    """

    prompt: str = ""
    negative_prompt: str | None = None
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    flow_shift: float | None = None
    seed: int = 0
    request_id: str | None = None
    output_type: str = "latent"
    image: Any = None
    bundle: Any = None
    output_path: str | None = None
    fps: int = 16
    progress: bool | None = None

    def __post_init__(self) -> None:
        if self.output_type not in OUTPUT_TYPES:
            raise InvalidRequestError(f"output_type: expected one of {OUTPUT_TYPES}, got {self.output_type!r}")
        if self.output_type == "mp4" and not self.output_path:
            raise InvalidRequestError("output_type='mp4' needs output_path (where to write the video)")
        if not isinstance(self.prompt, str):
            raise InvalidRequestError(f"prompt: expected a string, got {type(self.prompt).__name__}")
        for name in ("num_frames", "height", "width", "num_inference_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise InvalidRequestError(f"{name}: expected a positive integer, got {value!r}")
        for name in ("guidance_scale", "guidance_scale_2", "flow_shift"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int | float) or not np.isfinite(value)):
                raise InvalidRequestError(f"{name}: expected a finite number, got {value!r}")
        if self.flow_shift is not None and self.flow_shift <= 0:
            raise InvalidRequestError(f"flow_shift: must be > 0, got {self.flow_shift}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise InvalidRequestError(f"seed: expected a non-negative integer, got {self.seed!r}")
        if self.request_id is not None and (not isinstance(self.request_id, str) or not self.request_id):
            raise InvalidRequestError(f"request_id: expected a non-empty string, got {self.request_id!r}")
        if not isinstance(self.fps, int) or self.fps <= 0:
            raise InvalidRequestError(f"fps: expected a positive integer, got {self.fps!r}")

    def with_defaults(self, defaults: dict[str, Any]) -> DiffusionRequest:
        """Fill ``None`` fields from recipe defaults; give the request an id."""
        changes: dict[str, Any] = {}
        for name in ("negative_prompt", "num_frames", "height", "width", "num_inference_steps", "guidance_scale",
                     "guidance_scale_2", "flow_shift"):
            if getattr(self, name) is None and defaults.get(name) is not None:
                changes[name] = defaults[name]
        if self.request_id is None:
            changes["request_id"] = f"req-{uuid.uuid4().hex[:12]}"
        return replace(self, **changes) if changes else self


@dataclass
class DiffusionResult:
    """What ``generate`` returns.

    Attributes:
        request_id: the request's id.
        latents: final latents (video latents; BCTHW for Wan/SANA, packed rows for MiniMax-H3).
        frames: decoded uint8 frames ``(F, H, W, 3)`` when ``output_type`` is ``"np"``/``"mp4"``.
        audio_latents: MiniMax-H3 audio latents.
        video_path: the written MP4.
        receipts: install receipt and this request's execution report per plugin.
        timings: seconds for encode, each step, the denoise loop, decode and total.
        provenance: recipe, weight sources (random weights say so), schedule.
    """

    request_id: str
    latents: torch.Tensor
    frames: np.ndarray | None = None
    audio_latents: torch.Tensor | None = None
    video_path: str | None = None
    receipts: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    provenance: dict[str, Any] = field(default_factory=dict)
