"""MiniMax-H3 as a denoiser session: a conditioning bundle -> native runner -> audio/video latents.

A bundle is a directory with ``bundle.safetensors`` and ``manifest.json``. The manifest records the format,
every tensor's shape, dtype and SHA256 (of its raw little-endian bytes) and the file's SHA256; loading
verifies all of them. Tensors (``S`` = packed sequence length):

* ``video_latents`` (1, Nv, Cv) float32 — initial video rows: noise for target rows, clean latents for
  conditioning rows; ``video_target_mask`` (Nv,) uint8 — 1 where the row is denoised.
* ``audio_latents`` (1, Na, Ca) float32 — initial audio noise (all audio rows are denoised).
* ``text_embeds`` (1, Nt, text_dim) and optional ``negative_text_embeds`` — encoded text.
* ``token_tags`` (S,) int64 (0 video, 1 text, 2 audio), ``row_is_clean`` (S,) int64 (1 for rows at
  timestep 0: text and conditioning video rows), ``position_ids`` (S, 3) int64,
  ``video_indices`` / ``audio_indices`` / ``text_indices`` int64 positions in the packed sequence.

Building bundles from raw prompts and media is out of scope; :func:`build_random_h3_bundle` builds a
random valid one for a given model config (tiny recipes, tests, speed runs).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from worldfoundry.base_models.diffusion_model.drivers import PreparedInputs
from worldfoundry.base_models.diffusion_model.request import DiffusionRequest
from worldfoundry.errors import ArtifactMismatchError, CheckpointError, InvalidRequestError

BUNDLE_FORMAT = "worldfoundry-h3-bundle-v1"
_REQUIRED = ("video_latents", "video_target_mask", "audio_latents", "text_embeds", "token_tags", "row_is_clean",
             "position_ids", "video_indices", "audio_indices", "text_indices")


def tensor_sha256(t: torch.Tensor) -> str:
    data = t.detach().contiguous().cpu()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class H3Bundle:
    tensors: Mapping[str, torch.Tensor]
    manifest: Mapping[str, Any]
    path: str | None = None

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    @property
    def sequence_length(self) -> int:
        return int(self.tensors["token_tags"].shape[0])

    def validate(self, model_config: Mapping[str, Any] | None = None) -> None:
        """Check structure (and, with ``model_config``, channel sizes). Raises :class:`ArtifactMismatchError`."""
        t = self.tensors
        missing = [k for k in _REQUIRED if k not in t]
        if missing:
            raise ArtifactMismatchError(f"H3 bundle {self.path or ''}: missing tensors {missing}")
        s = self.sequence_length
        nv, na, nt = t["video_latents"].shape[1], t["audio_latents"].shape[1], t["text_embeds"].shape[1]
        checks = [
            (t["position_ids"].shape == (s, 3), "position_ids must be (S, 3)"),
            (t["row_is_clean"].shape == (s,), "row_is_clean must be (S,)"),
            (t["video_indices"].shape == (nv,), "video_indices must match video_latents rows"),
            (t["audio_indices"].shape == (na,), "audio_indices must match audio_latents rows"),
            (t["text_indices"].shape == (nt,), "text_indices must match text_embeds rows"),
            (t["video_target_mask"].shape == (nv,), "video_target_mask must match video_latents rows"),
            (nv + na + nt == s, f"video+audio+text rows ({nv}+{na}+{nt}) must equal S={s}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ArtifactMismatchError(f"H3 bundle {self.path or ''}: {message}")
        order = torch.cat([t["video_indices"], t["audio_indices"], t["text_indices"]]).sort().values
        if not torch.equal(order, torch.arange(s)):
            raise ArtifactMismatchError("H3 bundle: the three index tensors must partition 0..S-1")
        for key, tag in (("video_indices", 0), ("text_indices", 1), ("audio_indices", 2)):
            if not bool((t["token_tags"][t[key]] == tag).all()):
                raise ArtifactMismatchError(f"H3 bundle: token_tags disagree with {key} (expected tag {tag})")
        if model_config is not None:
            patch = model_config.get("patch_size", (1, 2, 2))
            cv = int(model_config["in_channels"]) * int(patch[0]) * int(patch[1]) * int(patch[2])
            for key, dim, expected in (("video_latents", 2, cv),
                                       ("audio_latents", 2, int(model_config["audio_in_channels"])),
                                       ("text_embeds", 2, int(model_config["text_dim"]))):
                if t[key].shape[dim] != expected:
                    raise ArtifactMismatchError(
                        f"H3 bundle: {key} has {t[key].shape[dim]} channels, the model expects {expected}"
                    )

    def save(self, directory: str | os.PathLike[str]) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous().cpu() for k, v in self.tensors.items()}
        save_file(tensors, str(out / "bundle.safetensors"))
        manifest = {
            "format": BUNDLE_FORMAT,
            "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch."),
                            "sha256": tensor_sha256(v)} for k, v in sorted(tensors.items())},
            "file_sha256": file_sha256(out / "bundle.safetensors"),
            **{k: v for k, v in self.manifest.items() if k not in ("format", "tensors", "file_sha256")},
        }
        (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
        return out


def load_h3_bundle(directory: str | os.PathLike[str]) -> H3Bundle:
    """Load and verify a bundle directory. Raises :class:`ArtifactMismatchError` on any hash mismatch."""
    root = Path(directory)
    manifest_path, data_path = root / "manifest.json", root / "bundle.safetensors"
    for p in (manifest_path, data_path):
        if not p.is_file():
            raise InvalidRequestError(f"H3 bundle {root}: missing {p.name}")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactMismatchError(f"H3 bundle {root}: manifest.json is not valid JSON: {exc}") from exc
    if manifest.get("format") != BUNDLE_FORMAT:
        raise ArtifactMismatchError(f"H3 bundle {root}: format {manifest.get('format')!r}, expected {BUNDLE_FORMAT}")
    if file_sha256(data_path) != manifest.get("file_sha256"):
        raise ArtifactMismatchError(f"H3 bundle {root}: bundle.safetensors does not match the manifest's SHA256")
    try:
        tensors = load_file(str(data_path))
    except Exception as exc:
        raise CheckpointError(f"H3 bundle {root}: cannot read bundle.safetensors: {exc}") from exc
    declared = manifest.get("tensors", {})
    if set(declared) != set(tensors):
        raise ArtifactMismatchError(f"H3 bundle {root}: manifest lists {sorted(declared)}, file has {sorted(tensors)}")
    for name, info in declared.items():
        if tensor_sha256(tensors[name]) != info.get("sha256") or list(tensors[name].shape) != info.get("shape"):
            raise ArtifactMismatchError(f"H3 bundle {root}: tensor {name!r} does not match its manifest entry")
    bundle = H3Bundle(tensors, manifest, str(root))
    bundle.validate()
    return bundle


def build_random_h3_bundle(model_config: Mapping[str, Any], *, latent_frames: int = 2, latent_height: int = 4,
                           latent_width: int = 4, condition_frames: int = 1, audio_rows: int = 8,
                           text_rows: int = 6, seed: int = 0, negative: bool = True) -> H3Bundle:
    """A random, structurally valid bundle for ``model_config`` (layout: text rows, video rows, audio rows)."""
    g = torch.Generator().manual_seed(seed)
    patch = model_config.get("patch_size", (1, 2, 2))
    cv = int(model_config["in_channels"]) * int(patch[0]) * int(patch[1]) * int(patch[2])
    ca, td = int(model_config["audio_in_channels"]), int(model_config["text_dim"])
    gh, gw = latent_height // int(patch[1]), latent_width // int(patch[2])
    nv = latent_frames * gh * gw
    s = text_rows + nv + audio_rows
    text_idx = torch.arange(text_rows)
    video_idx = torch.arange(text_rows, text_rows + nv)
    audio_idx = torch.arange(text_rows + nv, s)
    tags = torch.cat([torch.ones(text_rows), torch.zeros(nv), torch.full((audio_rows,), 2.0)]).long()
    frame = torch.arange(latent_frames).repeat_interleave(gh * gw)
    yy = torch.arange(gh).repeat_interleave(gw).repeat(latent_frames)
    xx = torch.arange(gw).repeat(gh * latent_frames)
    pos = torch.cat([torch.stack([torch.zeros(text_rows), torch.zeros(text_rows), torch.arange(text_rows)], 1),
                     torch.stack([frame, yy, xx], 1).float(),
                     torch.stack([torch.arange(audio_rows), torch.zeros(audio_rows), torch.zeros(audio_rows)], 1)])
    target = (frame >= condition_frames).to(torch.uint8)
    clean = torch.cat([torch.ones(text_rows), 1.0 - target.float(), torch.zeros(audio_rows)]).long()
    tensors = {
        "video_latents": torch.randn(1, nv, cv, generator=g),
        "video_target_mask": target,
        "audio_latents": torch.randn(1, audio_rows, ca, generator=g),
        "text_embeds": torch.randn(1, text_rows, td, generator=g),
        "token_tags": tags,
        "row_is_clean": clean,
        "position_ids": pos.long(),
        "video_indices": video_idx,
        "audio_indices": audio_idx,
        "text_indices": text_idx,
    }
    if negative:
        tensors["negative_text_embeds"] = torch.randn(1, text_rows, td, generator=g)
    bundle = H3Bundle(tensors, {"format": BUNDLE_FORMAT, "builder": "build_random_h3_bundle", "seed": seed})
    bundle.validate(model_config)
    return bundle


class H3Driver:
    """Runs a bundle through the MiniMax-H3 transformer; the runner state packs target video + audio rows."""

    family = "minimax_h3"

    def __init__(self, components: Any) -> None:
        self.c = components
        self.model = components.denoiser.model
        self.num_train_timesteps = int(components.scheduler.config.num_train_timesteps)

    def validate(self, request: DiffusionRequest) -> None:
        if request.bundle is None:
            raise InvalidRequestError("bundle: MiniMax-H3 runs from a conditioning bundle; pass DiffusionRequest(bundle=...)")

    def _bundle(self, request: DiffusionRequest) -> H3Bundle:
        bundle = request.bundle if isinstance(request.bundle, H3Bundle) else load_h3_bundle(request.bundle)
        bundle.validate(dict(self.model.config))
        return bundle

    def prepare(self, request: DiffusionRequest, device: torch.device, dtype: torch.dtype, cfg: bool) -> PreparedInputs:
        b = self._bundle(request)
        on = {k: v.to(device) for k, v in b.tensors.items()}
        target = on["video_target_mask"].bool()
        layout = {k: on[k] for k in ("token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")}
        layout["timestep_indices"] = on["row_is_clean"]
        branches = {"cond": {**layout, "encoder_hidden_states": on["text_embeds"].to(dtype)}}
        if cfg:
            negative = on.get("negative_text_embeds", torch.zeros_like(on["text_embeds"]))
            branches["uncond"] = {**layout, "encoder_hidden_states": negative.to(dtype)}
        video, audio = on["video_latents"].float(), on["audio_latents"].float()
        state = torch.cat([video[:, target].flatten(1), audio.flatten(1)], dim=1)
        extra = {"video": video, "target": target, "audio_shape": tuple(audio.shape), "bundle": b}
        return PreparedInputs(state, branches, extra)

    def split(self, prepared: PreparedInputs, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        video, target = prepared.extra["video"], prepared.extra["target"]
        n = int(target.sum()) * video.shape[2]
        full = video.clone()
        full[:, target] = state[:, :n].view(1, -1, video.shape[2])
        return full, state[:, n:].view(prepared.extra["audio_shape"])

    def model_kwargs(self, prepared: PreparedInputs, state: torch.Tensor, timestep: torch.Tensor, branch: str,
                     dtype: torch.dtype) -> dict[str, Any]:
        video, audio = self.split(prepared, state)
        sigma = timestep.reshape(1).float() / self.num_train_timesteps
        ts = torch.cat([sigma, sigma.new_zeros(1)])
        return {"hidden_states": video.to(dtype), "audio_hidden_states": audio.to(dtype), "timestep": ts,
                **prepared.branches[branch], "return_dict": False}

    def velocity_for(self, prepared: PreparedInputs, output: Any) -> torch.Tensor:
        video_v, audio_v = output[0], output[1]
        target = prepared.extra["target"]
        return torch.cat([video_v[:, target].float().flatten(1), audio_v.float().flatten(1)], dim=1)
