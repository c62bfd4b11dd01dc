"""Loader: local diffusers directories, original-format single files, missing/corrupt weights, recipes."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from worldfoundry import testing
from worldfoundry.base_models.diffusion_model.pipeline import DiffusionRequest, NativeDiffusionPipeline
from worldfoundry.core.model_loading.dtypes import apply_dtype_policy
from worldfoundry.core.model_loading.loader import split_component_options
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.core.model_loading.recipes import available_recipes, load_recipe, parse_recipe
from worldfoundry.errors import CheckpointError, MissingWeightsError, RecipeError, UnknownRecipeError

REAL = ["wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.1-i2v-14b-480p", "wan2.2-t2v-a14b", "wan2.2-ti2v-5b",
        "sana-video-2b-480p", "minimax-h3"]
TINY = ["tiny-wan2.1", "tiny-wan2.1-i2v", "tiny-wan2.2-a14b", "tiny-sana-video", "tiny-minimax-h3"]

# diffusers -> original Wan key fragments (the inverse of diffusers' single-file conversion), applied in order
_TO_ORIGINAL = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("attn1", "self_attn"),
    ("attn2", "cross_attn"),
    (".to_out.0.", ".o."),
    (".to_q.", ".q."),
    (".to_k.", ".k."),
    (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"),
    ("ffn.net.2", "ffn.2"),
    (".norm2.", ".norm3."),
    ("proj_out", "head.head"),
]


def to_original_wan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        new = key
        for a, b in _TO_ORIGINAL:
            new = new.replace(a, b)
        if new == "scale_shift_table":
            new = "head.modulation"
        elif new.endswith(".scale_shift_table"):
            new = new.replace(".scale_shift_table", ".modulation")
        out["model.diffusion_model." + new] = value.contiguous()
    return out


@pytest.fixture
def offline_tiny_recipe(tmp_path: Path) -> Path:
    """tiny-wan2.1 as a non-offline recipe (weights must come from a directory or file)."""
    data = yaml.safe_load(load_recipe("tiny-wan2.1").path.read_text())
    data.update(name="tiny-wan2.1-local", offline=False, hf_repo=None)
    path = tmp_path / "tiny-wan2.1-local.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_recipe_parses() -> None:
    names = available_recipes()
    for name in REAL + TINY:
        assert name in names
        recipe = load_recipe(name)
        assert recipe.name == name
        assert recipe.offline == (name in TINY)
    assert load_recipe("wan2.2-t2v-a14b").experts == ("high", "low")
    assert load_recipe("wan2.2-t2v-a14b").boundary_ratio == 0.875


def test_recipe_errors(tmp_path: Path) -> None:
    with pytest.raises(UnknownRecipeError) as info:
        load_recipe("nope")
    assert "tiny-wan2.1" in str(info.value)
    with pytest.raises(RecipeError, match="family"):
        parse_recipe({"name": "x", "family": "unet", "components": {"denoiser": {}}})
    with pytest.raises(RecipeError, match="unknown top-level"):
        parse_recipe({"name": "x", "family": "wan", "colour": 1, "components": {"denoiser": {}}})
    with pytest.raises(RecipeError, match="boundary_ratio"):
        parse_recipe({"name": "x", "family": "wan", "components": {"denoiser": {
            "experts": [{"name": "a"}, {"name": "b"}]}}})
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(RecipeError):
        load_recipe(bad)


def _save_tiny_as_diffusers(directory: Path) -> torch.Tensor:
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1") as pipe:
        c = pipe.components
        c.denoiser.model.save_pretrained(directory / "transformer")
        c.text_encoder.save_pretrained(directory / "text_encoder")
        c.codec.module.save_pretrained(directory / "vae")
        return pipe.generate(DiffusionRequest(prompt="a red ball", seed=5, output_type="np")).latents


def test_load_from_saved_diffusers_directory(tmp_path: Path, offline_tiny_recipe: Path) -> None:
    expected = _save_tiny_as_diffusers(tmp_path / "ckpt")
    with NativeDiffusionPipeline.from_pretrained(offline_tiny_recipe, checkpoint_dir=tmp_path / "ckpt") as pipe:
        kinds = {s.component: s.kind for s in pipe.components.sources}
        assert kinds["denoiser:model"] == "diffusers_dir" and kinds["codec"] == "diffusers_dir"
        assert pipe.components.random_weights is False
        got = pipe.generate(DiffusionRequest(prompt="a red ball", seed=5, output_type="np")).latents
    assert torch.equal(got, expected)


def test_load_transformer_from_original_single_file(tmp_path: Path, offline_tiny_recipe: Path) -> None:
    _save_tiny_as_diffusers(tmp_path / "ckpt")
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1") as ref:
        state = {k: v.clone() for k, v in ref.components.denoiser.model.state_dict().items()}
    single = tmp_path / "wan_original.safetensors"
    save_file(to_original_wan(state), str(single))
    with NativeDiffusionPipeline.from_pretrained(offline_tiny_recipe, checkpoint_dir=tmp_path / "ckpt",
                                                 checkpoint_overrides={"transformer": str(single)}) as pipe:
        src = {s.component: s for s in pipe.components.sources}["denoiser:model"]
        assert src.kind == "single_file" and src.path == str(single)
        loaded = pipe.components.denoiser.model.state_dict()
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key


def _count_live(cls: type) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is cls)


def test_missing_weights_names_recipe_component_and_paths(tmp_path: Path, offline_tiny_recipe: Path) -> None:
    from transformers import UMT5EncoderModel

    ckpt = tmp_path / "partial"
    _save_tiny_as_diffusers(ckpt)
    import shutil

    shutil.rmtree(ckpt / "transformer")
    before = _count_live(UMT5EncoderModel)
    with pytest.raises(MissingWeightsError) as info:
        NativeDiffusionPipeline.from_pretrained(offline_tiny_recipe, checkpoint_dir=ckpt)
    message = str(info.value)
    assert "tiny-wan2.1-local" in message and "denoiser:model" in message and str(ckpt / "transformer") in message
    assert _count_live(UMT5EncoderModel) == before, "the text encoder loaded before the failure must be released"


def test_real_recipe_without_weights_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(MissingWeightsError) as info:
        NativeDiffusionPipeline.from_pretrained("wan2.1-t2v-1.3b", checkpoint_dir=tmp_path / "nothing")
    assert "wan2.1-t2v-1.3b" in str(info.value) and "random-weights" in str(info.value).replace("_", "-")


def test_corrupt_safetensors_is_a_checkpoint_error(tmp_path: Path, offline_tiny_recipe: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _save_tiny_as_diffusers(ckpt)
    weights = next((ckpt / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="denoiser:model"):
        NativeDiffusionPipeline.from_pretrained(offline_tiny_recipe, checkpoint_dir=ckpt)


def test_override_missing_file_and_unknown_component(tmp_path: Path, offline_tiny_recipe: Path) -> None:
    with pytest.raises(MissingWeightsError, match="nope.safetensors"):
        NativeDiffusionPipeline.from_pretrained(offline_tiny_recipe, checkpoint_overrides={"vae": str(tmp_path / "nope.safetensors")},
                                                checkpoint_dir=tmp_path)
    with pytest.raises(RecipeError, match="unknown component"):
        NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", checkpoint_overrides={"unet": "x"})


def test_dtype_policy_keeps_fp32_modules() -> None:
    with NativeDiffusionPipeline.from_pretrained("tiny-wan2.1", policy=RuntimePolicy(dtype="bf16")) as pipe:
        model = pipe.components.denoiser.model
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
        assert dtypes["blocks.0.scale_shift_table"] == torch.float32
        assert dtypes["condition_embedder.time_embedder.linear_1.weight"] == torch.float32
        assert pipe.components.codec.dtype == torch.float32
        result = pipe.generate(DiffusionRequest(prompt="x", num_inference_steps=2))
        assert torch.isfinite(result.latents).all()


def test_component_options_override_runtime_options() -> None:
    assert split_component_options({"latent_encoder:codec": {"tiled": False}}) == {"codec": {"tiled": False}}
    policy = RuntimePolicy(options={"vae_dtype": "bf16", "dit_weight_dtype": "bf16"})
    with NativeDiffusionPipeline.from_pretrained(
        "tiny-wan2.1", policy=policy, component_options={"latent_encoder:codec": {"dtype": torch.float32}}
    ) as pipe:
        assert pipe.components.codec.dtype == torch.float32  # component option wins
        assert pipe.components.denoiser.model.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    with NativeDiffusionPipeline.from_pretrained("tiny-sana-video") as pipe:
        assert pipe.components.codec.tiled is True  # SANA-Video's recipe defaults to a tiled codec
    with NativeDiffusionPipeline.from_pretrained("tiny-sana-video",
                                                 component_options={"latent_encoder:codec": {"tiled": False}}) as pipe:
        assert pipe.components.codec.tiled is False


def test_apply_dtype_policy_rule() -> None:
    from diffusers import WanTransformer3DModel

    model = testing.seeded_model(WanTransformer3DModel, num_attention_heads=2, attention_head_dim=32, in_channels=4,
                                 out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1)
    apply_dtype_policy(model, torch.float16)
    assert model.proj_out.weight.dtype == torch.float16
    assert model.scale_shift_table.dtype == torch.float32


def test_pipeline_from_directory_infers_recipe(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _save_tiny_as_diffusers(ckpt)
    config = json.loads((ckpt / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "WanTransformer3DModel"
    with NativeDiffusionPipeline.from_pretrained(ckpt) as pipe:  # matches tiny-wan2.1's transformer config
        assert pipe.components.recipe.family == "wan"
