"""Checkpoint directories and files are checked before and after reading: missing and extra tensors are both
reported, NaN/Inf weights are refused by name, special files and oversized files are refused from their stat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from worldfoundry.core.model_loading.input_files import check_finite_tensors, check_input_file
from worldfoundry.core.model_loading.recipes import load_recipe
from worldfoundry.core.model_loading.weights import load_pretrained
from worldfoundry.errors import (
    CheckpointError,
    CheckpointKeysError,
    InputFileError,
    JsonInputError,
    NonFiniteWeightsError,
)

CPU = torch.device("cpu")


@pytest.fixture
def tiny_dir(tmp_path: Path) -> tuple[Path, object]:
    """A diffusers directory holding a tiny Wan transformer (``<dir>/transformer``)."""
    from diffusers import WanTransformer3DModel

    recipe = load_recipe("tiny-wan2.1")
    torch.manual_seed(0)
    WanTransformer3DModel.from_config(dict(recipe.denoiser.config)).save_pretrained(tmp_path / "ckpt" / "transformer")
    return tmp_path / "ckpt", recipe


def _weights(ckpt: Path) -> Path:
    return ckpt / "transformer" / "diffusion_pytorch_model.safetensors"


def _load(ckpt: Path, recipe):
    return load_pretrained(recipe.denoiser, recipe, subfolder="transformer", checkpoint_dir=str(ckpt), device=CPU,
                           dtype=None)


def test_intact_directory_loads(tiny_dir) -> None:
    module, source = _load(*tiny_dir)
    assert source.kind == "diffusers_dir" and not any(p.is_meta for p in module.parameters())


def test_missing_and_extra_tensors_are_both_reported(tiny_dir) -> None:
    ckpt, recipe = tiny_dir
    state = load_file(_weights(ckpt))
    dropped = sorted(state)[3]
    state.pop(dropped)
    state["blocks.9.surplus.weight"] = torch.zeros(2)
    save_file(state, _weights(ckpt))
    with pytest.raises(CheckpointKeysError) as info:
        _load(ckpt, recipe)
    assert info.value.missing == (dropped,) and info.value.unexpected == ("blocks.9.surplus.weight",)
    message = str(info.value)
    assert "1 missing tensor(s)" in message and "1 unexpected tensor(s)" in message and "meta" not in message


def test_one_missing_tensor_is_not_a_meta_tensor_crash(tiny_dir) -> None:
    ckpt, recipe = tiny_dir
    state = load_file(_weights(ckpt))
    state.pop(sorted(state)[0])
    save_file(state, _weights(ckpt))
    with pytest.raises(CheckpointKeysError, match="missing tensor"):
        _load(ckpt, recipe)


def test_nan_weight_is_refused_by_name(tiny_dir) -> None:
    ckpt, recipe = tiny_dir
    state = load_file(_weights(ckpt))
    key = sorted(k for k in state if k.endswith("weight"))[0]
    state[key] = state[key].clone()
    state[key].view(-1)[0] = float("nan")
    save_file(state, _weights(ckpt))
    with pytest.raises(NonFiniteWeightsError) as info:
        _load(ckpt, recipe)
    assert info.value.key == key and "1 NaN/Inf" in str(info.value)


def test_weight_file_that_is_a_device_is_refused_before_reading(tiny_dir) -> None:
    ckpt, recipe = tiny_dir
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    _weights(ckpt).unlink()
    _weights(ckpt).symlink_to("/dev/zero")
    with pytest.raises(InputFileError, match="character device"):
        _load(ckpt, recipe)


def test_corrupt_config_and_escaping_shard_index(tiny_dir) -> None:
    ckpt, recipe = tiny_dir
    config = ckpt / "transformer" / "config.json"
    good = config.read_text()
    config.write_text(good.replace('"num_layers": 2', '"num_layers": 2, "num_layers": 40'))
    with pytest.raises(JsonInputError, match="duplicate key 'num_layers'"):
        _load(ckpt, recipe)
    config.write_text(good)
    index = ckpt / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"blocks.0.ffn.net.0.proj.weight": "../../../etc/passwd"}}))
    with pytest.raises(CheckpointError, match="not a file name inside"):
        _load(ckpt, recipe)


def test_truncated_safetensors_header_is_refused_before_loading(tiny_dir) -> None:
    ckpt, recipe = tiny_dir
    _weights(ckpt).write_bytes(_weights(ckpt).read_bytes()[:100])
    with pytest.raises(CheckpointError, match="denoiser"):
        _load(ckpt, recipe)


def test_size_bound_is_checked_from_the_stat(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    with open(big, "wb") as handle:
        handle.truncate(1 << 30)  # sparse: 1 GiB by stat, nothing read
    with pytest.raises(InputFileError, match="more than the 1024-byte limit"):
        check_input_file(big, what="weight file", max_bytes=1024)


def test_finiteness_check_names_the_first_bad_tensor() -> None:
    good, bad = torch.ones(3), torch.tensor([1.0, float("inf"), float("nan")])
    check_finite_tensors({"a": good, "i": torch.arange(3)}, where="f")
    with pytest.raises(NonFiniteWeightsError, match="'b' holds 2 NaN/Inf"):
        check_finite_tensors({"a": good, "b": bad}, where="f")


def test_tensor_store_refuses_a_fifo_without_blocking(tmp_path: Path) -> None:
    import os

    from worldfoundry.core.model_loading.tensor_store import SafetensorsTensorStore

    fifo = tmp_path / "w.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):
        SafetensorsTensorStore(fifo)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_tokenizer_files_are_stat_checked(tiny_dir) -> None:
    from worldfoundry.core.model_loading.weights import check_component_dir

    tok = tiny_dir[0] / "tokenizer"
    tok.mkdir()
    (tok / "spiece.model").symlink_to("/dev/zero")
    with pytest.raises(InputFileError, match="character device"):
        check_component_dir(tok)
