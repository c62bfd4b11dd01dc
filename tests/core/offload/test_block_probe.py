"""One real block + request-shaped inputs for the estimator, and the c / d timers (CPU, emulated)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel, SanaVideoTransformer3DModel, WanTransformer3DModel

from worldfoundry import testing
from worldfoundry.base_models.diffusion_model.optimizations.families import family_of
from worldfoundry.core.model_loading.dtypes import apply_dtype_policy
from worldfoundry.core.offload.block_probe import (
    build_probe_block,
    build_probe_inputs,
    resolve_dit_source,
)
from worldfoundry.core.offload.host_storage import HostBlockStorage
from worldfoundry.core.offload.layout import BlockLayout
from worldfoundry.core.offload.measure import time_block_compute, time_block_transfer
from worldfoundry.errors import CheckpointError, RecipeError

WAN = dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=16, freq_dim=16,
           ffn_dim=32, num_layers=3, rope_max_seq_len=32)
H3 = dict(num_attention_heads=2, attention_head_dim=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
          ffn_dim=64, in_channels=4, audio_in_channels=4, text_dim=16, freq_dim=16, time_embed_hidden_dim=32,
          time_embed_dim=16, rope_freq_dim=2)
CPU = torch.device("cpu")
RECIPES = Path(__file__).resolve().parents[3] / "recipes"


def _config_file(tmp_path, cls, config) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"_class_name": cls.__name__, **config}))
    return str(path)


def _captured_block_inputs(model, call) -> dict:
    seen = {}

    def grab(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs

    hook = model.transformer_blocks[0].register_forward_pre_hook(grab, with_kwargs=True) if hasattr(
        model, "transformer_blocks") else model.blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        call()
    hook.remove()
    return seen


def test_wan_probe_matches_the_models_own_block_inputs(tmp_path) -> None:
    source = resolve_dit_source(_config_file(tmp_path, WanTransformer3DModel, WAN))
    assert source.class_path == "diffusers.WanTransformer3DModel"
    probe = build_probe_block(source, family_of=family_of, device=CPU, dtype=torch.bfloat16, random_weights=True, index=1)
    assert probe.family == "wan" and probe.path == "blocks.1" and probe.num_blocks == 3
    assert probe.block.scale_shift_table.dtype == torch.float32  # fp32-kept modules stay fp32
    assert probe.block.ffn.net[2].weight.dtype == torch.bfloat16
    inputs = build_probe_inputs(probe, frames=5, height=32, width=48, device=CPU, dtype=torch.bfloat16)
    assert inputs.tokens == 2 * 2 * 3  # latent 2 x 4 x 6, patch (1, 2, 2)

    model = apply_dtype_policy(testing.seeded_model(WanTransformer3DModel, **WAN), torch.bfloat16)
    text = torch.randn(1, 512, WAN["text_dim"], dtype=torch.bfloat16)
    latents = torch.randn(1, WAN["in_channels"], 2, 4, 6, dtype=torch.bfloat16)
    real = _captured_block_inputs(model, lambda: model(latents, torch.tensor([500]), text))
    hidden, encoder, temb, rotary = real["args"]
    fresh = inputs.make()
    for name, want in (("hidden_states", hidden), ("encoder_hidden_states", encoder), ("temb", temb)):
        assert fresh[name].shape == want.shape and fresh[name].dtype == want.dtype, name
    for ours, theirs in zip(fresh["rotary_emb"], rotary):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)  # the model's own rotary embedding
    assert fresh["hidden_states"] is not inputs.make()["hidden_states"]  # reset per call
    with torch.no_grad():
        out = probe.block(**fresh)
    assert out.shape == hidden.shape and torch.isfinite(out.float()).all()


def test_h3_probe_matches_the_models_own_block_inputs(tmp_path) -> None:
    source = resolve_dit_source(_config_file(tmp_path, MiniMaxH3Transformer3DModel, H3))
    probe = build_probe_block(source, family_of=family_of, device=CPU, dtype=torch.bfloat16, random_weights=True)
    inputs = build_probe_inputs(probe, frames=5, height=64, width=64, device=CPU, dtype=torch.bfloat16,
                                sequence_length=40)
    assert inputs.tokens == 40
    fresh = inputs.make()
    model = apply_dtype_policy(testing.seeded_model(MiniMaxH3Transformer3DModel, **H3), torch.bfloat16)
    rows, text, video = 40, 5, 35
    real = _captured_block_inputs(model, lambda: model(
        hidden_states=torch.randn(1, video, 16), audio_hidden_states=torch.randn(1, 0, 4),
        encoder_hidden_states=torch.randn(1, text, 16), timestep=torch.tensor([0.0, 0.5]),
        timestep_indices=torch.cat([torch.zeros(text), torch.ones(video)]).long(),
        token_tags=torch.cat([torch.ones(text), torch.zeros(video)]).long(),
        position_ids=torch.zeros(rows, 3, dtype=torch.long), video_indices=torch.arange(text, rows),
        audio_indices=torch.arange(0), text_indices=torch.arange(text)))
    hidden, temb, adaln, rotary = real["args"]
    assert fresh["hidden_states"].shape == hidden.shape and fresh["hidden_states"].dtype == hidden.dtype
    assert fresh["temb"].shape == temb.shape and fresh["temb"].dtype == temb.dtype
    assert fresh["adaln_indices"].shape == adaln.shape and fresh["adaln_indices"].dtype == adaln.dtype
    assert int(fresh["adaln_indices"].max()) < 2 * 3
    for ours, theirs in zip(fresh["rotary_emb"], rotary):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    with torch.no_grad():
        assert probe.block(**fresh).shape == hidden.shape
    rows_from_size = build_probe_inputs(probe, frames=5, height=64, width=64, device=CPU, dtype=torch.bfloat16)
    assert rows_from_size.tokens == 2 * 2 * 2 + 512  # latent 2 x 4 x 4 -> patches 2 x 2 x 2, plus text rows


def test_block_weights_come_from_the_checkpoint(tmp_path) -> None:
    model = testing.seeded_model(WanTransformer3DModel, 0, **WAN)
    model.save_pretrained(tmp_path / "ckpt" / "transformer")
    source = resolve_dit_source(_config_file(tmp_path, WanTransformer3DModel, WAN), tmp_path / "ckpt")
    assert source.weights_dir == tmp_path / "ckpt" / "transformer"
    probe = build_probe_block(source, family_of=family_of, device=CPU, dtype=torch.float32, random_weights=False, index=2)
    for name, p in probe.block.named_parameters():
        assert torch.equal(p, model.blocks[2].get_parameter(name)), name
    assert str(tmp_path) in probe.weights


def test_sana_video_probe_matches_the_models_own_block_inputs() -> None:
    source = resolve_dit_source("tiny-sana-video")
    probe = build_probe_block(source, family_of=family_of, device=CPU, dtype=torch.bfloat16, random_weights=True)
    assert probe.family == "sana_video" and probe.path == "transformer_blocks.0"
    inputs = build_probe_inputs(probe, frames=9, height=64, width=64, device=CPU, dtype=torch.bfloat16)
    assert inputs.tokens == 3 * 4 * 4  # latent 3 x 8 x 8, patch (1, 2, 2)
    fresh = inputs.make()

    model = apply_dtype_policy(testing.seeded_model(SanaVideoTransformer3DModel, 0, **source.config), torch.bfloat16)
    text = probe.text_tokens or 300
    latents = torch.randn(1, source.config["in_channels"], 3, 8, 8, dtype=torch.bfloat16)
    caption = torch.randn(1, text, source.config["caption_channels"], dtype=torch.bfloat16)
    real = _captured_block_inputs(model, lambda: model(latents, caption, torch.tensor([500])))
    names = ("hidden_states", "attention_mask", "encoder_hidden_states", "encoder_attention_mask", "timestep",
             "frames", "height", "width", "rotary_emb")
    theirs = dict(zip(names, real["args"]))
    for name in ("hidden_states", "encoder_hidden_states", "timestep"):
        assert fresh[name].shape == theirs[name].shape and fresh[name].dtype == theirs[name].dtype, name
    assert (fresh["frames"], fresh["height"], fresh["width"]) == (theirs["frames"], theirs["height"],
                                                                   theirs["width"]) == (3, 4, 4)
    for ours, want in zip(fresh["rotary_emb"], theirs["rotary_emb"]):
        assert ours.dtype == want.dtype and torch.equal(ours, want)  # the model's own rotary embedding
    with torch.no_grad():
        out = probe.block(**fresh)
    assert out.shape == theirs["hidden_states"].shape and torch.isfinite(out.float()).all()
    with pytest.raises(RecipeError, match="minimax_h3"):
        build_probe_inputs(probe, frames=9, height=64, width=64, device=CPU, dtype=torch.bfloat16, sequence_length=8)


def test_per_token_timesteps_and_codec_stride_come_from_the_recipe(tmp_path, monkeypatch) -> None:
    """A Wan2.2 TI2V-style recipe (16× spatial codec, one timestep per token): the probe's latent grid and
    modulation match what the model passes its blocks."""
    text = (RECIPES / "tiny-wan2.1.yaml").read_text()
    text = text.replace("name: tiny-wan2.1", "name: tiny-ti2v-probe")
    text = text.replace("class: diffusers.WanTransformer3DModel", "class: diffusers.WanTransformer3DModel\n"
                        "    expand_timesteps: true")
    text = text.replace("temperal_downsample: [false, true, true]}",
                        "temperal_downsample: [false, true, true], scale_factor_spatial: 16}")
    (tmp_path / "tiny-ti2v-probe.yaml").write_text(text)
    monkeypatch.setenv("WORLDFOUNDRY_RECIPES", str(tmp_path))
    source = resolve_dit_source("tiny-ti2v-probe")
    assert (source.spatial_stride, source.temporal_stride, source.expand_timesteps) == (16, 4, True)
    assert (resolve_dit_source("tiny-wan2.1").spatial_stride, resolve_dit_source("tiny-wan2.1").expand_timesteps) \
        == (8, False)
    probe = build_probe_block(source, family_of=family_of, device=CPU, dtype=torch.float32, random_weights=True)
    inputs = build_probe_inputs(probe, frames=9, height=64, width=128, device=CPU, dtype=torch.float32)
    assert inputs.tokens == 3 * 2 * 4  # latent 3 x 4 x 8 (16x spatial), patch (1, 2, 2)
    fresh = inputs.make()

    model = testing.seeded_model(WanTransformer3DModel, **source.config)
    latents = torch.randn(1, source.config["in_channels"], 3, 4, 8)
    timestep = torch.full((1, inputs.tokens), 500)  # one per token, as the Wan2.2 TI2V driver passes them
    real = _captured_block_inputs(model, lambda: model(latents, timestep, torch.randn(1, 16, 32)))
    hidden, _encoder, temb, _rotary = real["args"]
    assert fresh["hidden_states"].shape == hidden.shape
    assert fresh["temb"].shape == temb.shape == (1, inputs.tokens, 6, 64)
    with torch.no_grad():
        assert probe.block(**fresh).shape == hidden.shape


def test_recipe_source_and_errors(tmp_path) -> None:
    source = resolve_dit_source("tiny-wan2.1")
    assert source.class_path.endswith("WanTransformer3DModel") and source.config["num_layers"] == 2
    with pytest.raises(CheckpointError, match="--random-weights"):
        build_probe_block(source, family_of=family_of, device=CPU, dtype=torch.float32, random_weights=False)
    with pytest.raises(RecipeError, match="outside"):
        build_probe_block(source, family_of=family_of, device=CPU, dtype=torch.float32, random_weights=True, index=5)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_dit_source("tiny-wan2.1", tmp_path / "missing")
    probe = build_probe_block(source, family_of=family_of, device=CPU, dtype=torch.float32, random_weights=True)
    with pytest.raises(RecipeError, match="minimax_h3"):
        build_probe_inputs(probe, frames=5, height=32, width=32, device=CPU, dtype=torch.float32, sequence_length=8)


@pytest.mark.parametrize("contiguous", [False, True])
def test_timers_return_medians_of_the_samples(tmp_path, contiguous: bool) -> None:
    source = resolve_dit_source(_config_file(tmp_path, WanTransformer3DModel, WAN))
    probe = build_probe_block(source, family_of=family_of, device=CPU, dtype=torch.float32, random_weights=True)
    inputs = build_probe_inputs(probe, frames=5, height=32, width=32, device=CPU, dtype=torch.float32)
    calls = {"n": 0}
    original = inputs.make

    def counting():
        calls["n"] += 1
        return original()

    compute = time_block_compute(probe.block, counting, device=CPU, warmup=3, samples=10)
    assert calls["n"] == 3 + 10 * 4 and len(compute.samples_ms) == 10 and compute.timer == "perf_counter"
    assert min(compute.samples_ms) <= compute.median_ms <= max(compute.samples_ms)
    named = list(probe.block.named_parameters())
    storage = HostBlockStorage.from_tensors(BlockLayout.from_tensors(named), [p for _, p in named],
                                            contiguous=contiguous, pin=False)
    transfer = time_block_transfer(storage, device=CPU, warmup=1, samples=4)
    assert len(transfer.samples_ms) == 4 and transfer.median_ms >= 0
    assert set(transfer.to_json()) >= {"median_ms", "samples_ms", "warmup", "timer"}
    with pytest.raises(ValueError):
        time_block_transfer(storage, device=CPU, samples=0)
