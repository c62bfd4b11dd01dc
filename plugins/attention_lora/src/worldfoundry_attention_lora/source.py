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


def load_adapter_file(path: str | os.PathLike[str]) -> AdapterSource:
    """Read a ``.safetensors`` adapter once: hash the bytes and load the tensors from the same bytes.

    Args:
        path: the adapter file.

    Returns:
        The :class:`AdapterSource` (tensors on the CPU, in the dtype stored in the file).

    Raises:
        AccelerationOptionsError: the file does not exist or cannot be read.
        ArtifactMismatchError: the file is not a valid safetensors file.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise AccelerationOptionsError(NAME, f"cannot read adapter file {path!r}: {exc.strerror or exc}") from exc
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
        ArtifactMismatchError: ``state`` is not a mapping of string keys to tensors.
    """
    if not isinstance(state, Mapping):
        raise ArtifactMismatchError(f"an adapter state must be a mapping of key -> tensor, got {type(state).__name__}")
    digest = hashlib.sha256()
    for key in sorted(state, key=str):
        value = state[key]
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ArtifactMismatchError(f"{key!r}: adapter states map string keys to tensors, got {type(value).__name__}")
        tensor = value.detach().to("cpu").contiguous()
        digest.update(key.encode() + b"\0" + str(tensor.dtype).encode() + b"\0" + repr(tuple(tensor.shape)).encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return AdapterSource(dict(state), digest.hexdigest(), IDENTITY_STATE)
