"""Where an adapter state comes from, and its identity (SHA256) that results must carry."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch

from worldfoundry.plugin import AccelerationOptionsError, ArtifactMismatchError
from worldfoundry_attention_lora.options import NAME

IDENTITY_FILE: Final = "file_sha256"
IDENTITY_STATE: Final = "state_dict_sha256"

#: Largest adapter file read (the released MiniMax-H3 attention adapters are a few hundred MiB).
MAX_ADAPTER_BYTES: Final = 16 << 30


@dataclass(frozen=True)
class AdapterSource:
    """An adapter state with its identity.

    Attributes:
        state: ``{key: tensor}`` as loaded (CPU).
        sha256: hex digest of the file bytes (``identity_kind == "file_sha256"``) or of the canonical
            serialisation of an in-memory state (``"state_dict_sha256"``: every key in sorted order, its dtype,
            shape and raw little-endian bytes).
        identity_kind: which of the two digests ``sha256`` is.
        path: the file path, ``None`` for an in-memory state.
        size_bytes: the file size, ``None`` for an in-memory state.
    """

    state: Mapping[str, Any]
    sha256: str
    identity_kind: str
    path: str | None = None
    size_bytes: int | None = None


def load_adapter_file(path: str | os.PathLike[str] | None) -> AdapterSource:
    """Read a ``.safetensors`` adapter once: hash the bytes and load the tensors from the same bytes.

    The path is stat-checked first: a regular file (not a directory, FIFO or device such as ``/dev/zero``) of at
    most :data:`MAX_ADAPTER_BYTES`.

    Args:
        path: the adapter file.

    Returns:
        The :class:`AdapterSource` (tensors on the CPU, in the dtype stored in the file).

    Raises:
        AccelerationOptionsError: no path, or the file does not exist, is not a regular file, is too large or
            cannot be read.
        ArtifactMismatchError: the file is not a valid safetensors file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    from worldfoundry.core.model_loading.input_files import read_input_bytes
    from worldfoundry.errors import InputFileError

    if path is None or not os.fspath(path):
        raise AccelerationOptionsError(
            NAME, "path: no adapter file given (path is null or empty); set path to the .safetensors adapter file, "
            "or hand the state over in memory with attention_lora_context(model, state_dict=...)", path="path")
    path = os.fspath(path)
    try:
        data = read_input_bytes(path, what="adapter file", max_bytes=MAX_ADAPTER_BYTES)
    except InputFileError as exc:
        raise AccelerationOptionsError(NAME, f"path: cannot read adapter file: {exc}", path="path") from exc
    try:
        state = load_safetensors(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise ArtifactMismatchError(f"{path!r} is not a readable safetensors file: {exc}") from exc
    return AdapterSource(state, hashlib.sha256(data).hexdigest(), IDENTITY_FILE, path, len(data))


def state_dict_source(state: Mapping[str, Any]) -> AdapterSource:
    """Wrap an in-memory adapter state, hashing it canonically (the state is validated later).

    Args:
        state: ``{key: tensor}``.

    Returns:
        The :class:`AdapterSource`.

    Raises:
        ArtifactMismatchError: ``state`` is not a mapping of string keys to tensors, or holds a meta or
            non-strided tensor.
    """
    if not isinstance(state, Mapping):
        raise ArtifactMismatchError(f"an adapter state must be a mapping of key -> tensor, got {type(state).__name__}")
    digest = hashlib.sha256()
    for key in sorted(state, key=str):
        value = state[key]
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ArtifactMismatchError(f"{key!r}: adapter states map string keys to tensors, got {type(value).__name__}")
        if value.is_meta:
            raise ArtifactMismatchError(
                f"{key!r}: a meta tensor (shape only, no values); materialise the adapter state before handing it "
                "over (e.g. load it from its file)")
        if value.layout != torch.strided:
            raise ArtifactMismatchError(f"{key!r}: a {value.layout} tensor; pass dense (strided) tensors")
        tensor = value.detach().to("cpu").contiguous()
        digest.update(key.encode() + b"\0" + str(tensor.dtype).encode() + b"\0" + repr(tuple(tensor.shape)).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return AdapterSource(dict(state), digest.hexdigest(), IDENTITY_STATE)
