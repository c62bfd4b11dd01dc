"""The ``worldfoundry-svdquant-v1`` artifact: safetensors tensors + a JSON manifest, strict reading and writing.

Two containers hold the same content:

* ``NAME.json`` (manifest) next to ``NAME.safetensors`` (tensors); the manifest names the tensor file with its
  size and SHA256 (``tensors.file``, ``tensors.size_bytes``, ``tensors.sha256``);
* ``NAME.pt``: ``torch.save({"manifest": {...}, "tensors": {name: tensor}})``, read only with
  ``torch.load(weights_only=True)``.

Manifest fields: ``format`` (``worldfoundry-svdquant-v1``), ``method`` (``svdquant`` | ``rtn``), ``rank``,
``group_size`` (64, 128, or 0: one scale per output channel for the whole ``K``), ``alpha`` (``null`` without smoothing), ``svd``, ``weight_bits`` (4), ``activation_bits`` (8),
``include`` (the calibration's patterns), ``model`` (class, family), ``calibration`` (provenance: recipe,
prompts, seeds, frames, size, steps, versions, time) and ``linears``: per Linear path its ``in_features``,
``out_features``, ``rank``, ``smoothed``, ``source`` (``weight`` and ``bias``: ``sha256``, ``shape``,
``dtype``, as :func:`~worldfoundry.core.acceleration.quantization.parameter_digest.tensor_sha256`),
``calibration`` (calls, rows) and ``diagnostics`` (``weight_rel_l2``).

Tensors of a Linear ``P``: ``P.qweight`` int8 ``[N, K/2]``, ``P.scales`` bfloat16 ``[K/G, N]`` (``[1, N]`` per channel), and when
present ``P.inv_smooth`` float32 ``[K]``, ``P.lora_down`` bfloat16 ``[r, K]``, ``P.lora_up`` bfloat16 ``[N, r]``.

Reading checks, before any tensor is built, the manifest schema, the tensor file's size and digest, and every
tensor's name, dtype and shape from the safetensors header; after loading, that scales, smoothing and low-rank
factors are finite (scales and smoothing positive). Every failure is an
:class:`~worldfoundry.errors.ArtifactFormatError` naming the file and the field.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from worldfoundry.core.acceleration.quantization.int4_packing import SCALE_GROUPINGS, k_multiple, scale_groups
from worldfoundry.core.acceleration.quantization.svdquant_numerics import SVDQuantWeight
from worldfoundry.errors import ArtifactFormatError

ARTIFACT_FORMAT: Final = "worldfoundry-svdquant-v1"
METHODS: Final = ("svdquant", "rtn")
MAX_MANIFEST_BYTES: Final = 64 * 2**20
_TENSOR_SPECS: Final = {  # name -> (dtype, shape builder(in, out, rank, group))
    "qweight": (torch.int8, lambda k, n, r, g: (n, k // 2)),
    "scales": (torch.bfloat16, lambda k, n, r, g: (scale_groups(k, g), n)),
    "inv_smooth": (torch.float32, lambda k, n, r, g: (k,)),
    "lora_down": (torch.bfloat16, lambda k, n, r, g: (r, k)),
    "lora_up": (torch.bfloat16, lambda k, n, r, g: (n, r)),
}
_SAFETENSORS_DTYPES: Final = {"I8": torch.int8, "BF16": torch.bfloat16, "F32": torch.float32}


@dataclass(frozen=True)
class LinearEntry:
    """One Linear of the manifest."""

    path: str
    in_features: int
    out_features: int
    rank: int
    smoothed: bool
    source: dict[str, Any]
    record: dict[str, Any]

    def expected_tensors(self, group_size: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        names = ["qweight", "scales"] + (["inv_smooth"] if self.smoothed else []) + (
            ["lora_down", "lora_up"] if self.rank else [])
        return {f"{self.path}.{n}": (_TENSOR_SPECS[n][0], _TENSOR_SPECS[n][1](
            self.in_features, self.out_features, self.rank, group_size)) for n in names}


@dataclass(frozen=True)
class SVDQuantArtifact:
    """A read and checked artifact: its manifest, entries and a loader for each Linear's tensors."""

    file: str
    manifest: dict[str, Any]
    linears: dict[str, LinearEntry]
    tensors: dict[str, torch.Tensor]

    @property
    def group_size(self) -> int:
        return int(self.manifest["group_size"])

    def weight(self, path: str, device: torch.device | str = "cpu") -> SVDQuantWeight:
        """The :class:`SVDQuantWeight` of ``path`` on ``device``."""
        get = self.tensors.get
        pick = {n: get(f"{path}.{n}") for n in ("qweight", "scales", "inv_smooth", "lora_down", "lora_up")}
        return SVDQuantWeight(pick["qweight"], pick["scales"], self.group_size, pick["inv_smooth"],
                              pick["lora_down"], pick["lora_up"]).to(device)


def _fail(file: str, field: str, message: str) -> ArtifactFormatError:
    return ArtifactFormatError(file, field, message)


def _int(file: str, field: str, value: Any, lo: int = 0, hi: int = 1 << 31) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _fail(file, field, f"expected an integer in [{lo}, {hi}], got {value!r}")
    return value


def check_manifest(manifest: Any, file: str) -> dict[str, LinearEntry]:
    """Validate the manifest's schema; return its Linear entries.

    Raises:
        ArtifactFormatError: naming the file and the first bad field.
    """
    if not isinstance(manifest, Mapping):
        raise _fail(file, "<root>", f"expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != ARTIFACT_FORMAT:
        raise _fail(file, "format", f"expected {ARTIFACT_FORMAT!r}, got {manifest.get('format')!r} "
                    "(Nunchaku or other SVDQuant checkpoints cannot be read; calibrate with `worldfoundry calibrate svdquant`)")
    if manifest.get("method") not in METHODS:
        raise _fail(file, "method", f"expected one of {list(METHODS)}, got {manifest.get('method')!r}")
    group = manifest.get("group_size")
    if isinstance(group, bool) or group not in SCALE_GROUPINGS:
        raise _fail(file, "group_size", f"expected 64, 128 or 0 (per output channel), got {group!r}")
    _int(file, "rank", manifest.get("rank"), 0, 1 << 16)
    for key, want in (("weight_bits", 4), ("activation_bits", 8)):
        if manifest.get(key) != want:
            raise _fail(file, key, f"expected {want}, got {manifest.get(key)!r}")
    for key in ("include", "calibration", "model"):
        if key not in manifest:
            raise _fail(file, key, "missing")
    linears = manifest.get("linears")
    if not isinstance(linears, Mapping) or not linears:
        raise _fail(file, "linears", "expected a non-empty object of Linear paths")
    entries = {}
    for path, rec in linears.items():
        where = f"linears[{path!r}]"
        if not isinstance(path, str) or not path or not isinstance(rec, Mapping):
            raise _fail(file, where, "expected a module path mapping to an object")
        k = _int(file, f"{where}.in_features", rec.get("in_features"), 1)
        n = _int(file, f"{where}.out_features", rec.get("out_features"), 1)
        r = _int(file, f"{where}.rank", rec.get("rank"), 0, min(k, n))
        if k % k_multiple(group):
            raise _fail(file, f"{where}.in_features", f"{k} is not a multiple of {k_multiple(group)} "
                        f"(group_size {group})")
        smoothed = rec.get("smoothed")
        if not isinstance(smoothed, bool):
            raise _fail(file, f"{where}.smoothed", f"expected true/false, got {smoothed!r}")
        source = rec.get("source")
        if not isinstance(source, Mapping) or not isinstance(source.get("weight"), Mapping):
            raise _fail(file, f"{where}.source.weight", "missing the source parameter digest")
        for pname in ("weight", "bias"):
            digest = source.get(pname)
            if digest is None and pname == "bias":
                continue
            if not isinstance(digest, Mapping) or not isinstance(digest.get("sha256"), str) or len(digest["sha256"]) != 64:
                raise _fail(file, f"{where}.source.{pname}.sha256", "expected a 64-character SHA256 hex digest")
        entries[path] = LinearEntry(path, k, n, r, smoothed, dict(source), dict(rec))
    return entries


def _check_header(file: str, entries: Mapping[str, LinearEntry], group: int,
                  header: Mapping[str, tuple[torch.dtype | str, tuple[int, ...]]]) -> None:
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for entry in entries.values():
        expected.update(entry.expected_tensors(group))
    extra = sorted(set(header) - set(expected))
    if extra:
        raise _fail(file, f"tensors[{extra[0]!r}]", f"not described by the manifest ({len(extra)} such tensor(s))")
    for name, (dtype, shape) in expected.items():
        if name not in header:
            raise _fail(file, f"tensors[{name!r}]", "missing")
        got_dtype, got_shape = header[name]
        if got_dtype != dtype or tuple(got_shape) != shape:
            raise _fail(file, f"tensors[{name!r}]", f"expected {str(dtype).removeprefix('torch.')} {list(shape)}, "
                        f"got {str(got_dtype).removeprefix('torch.')} {list(got_shape)}")


def _check_values(file: str, tensors: Mapping[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        kind = name.rsplit(".", 1)[-1]
        if kind == "qweight":
            continue
        if not bool(torch.isfinite(tensor).all()):
            raise _fail(file, f"tensors[{name!r}]", "contains NaN or Inf")
        if kind in ("scales", "inv_smooth") and tensor.numel() and not bool((tensor > 0).all()):
            raise _fail(file, f"tensors[{name!r}]", "must be positive")


def _read_json(path: Path) -> dict[str, LinearEntry] | Any:
    file = str(path)
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise _fail(file, "<root>", f"manifest larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(file, "<root>", f"not valid JSON ({exc})") from exc


def _load_safetensors(manifest: Mapping[str, Any], manifest_path: Path,
                      entries: Mapping[str, LinearEntry]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    from worldfoundry.core.model_loading.file_digest import file_sha256

    file = str(manifest_path)
    spec = manifest.get("tensors")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("file"), str):
        raise _fail(file, "tensors.file", "missing the name of the safetensors file")
    name = spec["file"]
    if Path(name).name != name or not name.endswith(".safetensors"):
        raise _fail(file, "tensors.file", f"must be a .safetensors file name beside the manifest, got {name!r}")
    tensor_path = manifest_path.parent / name
    if not tensor_path.is_file():
        raise _fail(file, "tensors.file", f"{tensor_path} does not exist")
    size = tensor_path.stat().st_size
    if spec.get("size_bytes") != size:
        raise _fail(str(tensor_path), "size", f"{size} bytes, the manifest records {spec.get('size_bytes')!r}")
    if spec.get("sha256") != file_sha256(tensor_path):
        raise _fail(str(tensor_path), "sha256", "differs from the manifest's tensors.sha256 (file changed)")
    try:
        with safe_open(str(tensor_path), framework="pt") as handle:
            header = {}
            for key in handle.keys():
                sl = handle.get_slice(key)
                header[key] = (_SAFETENSORS_DTYPES.get(sl.get_dtype(), sl.get_dtype()), tuple(sl.get_shape()))
            _check_header(str(tensor_path), entries, int(manifest["group_size"]), header)
            tensors = {key: handle.get_tensor(key) for key in header}
    except ArtifactFormatError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise _fail(str(tensor_path), "<file>", f"not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
    return tensors


def _load_pt(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    file = str(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for unreadable or unsafe files
        raise _fail(file, "<file>", f"not readable with torch.load(weights_only=True) ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, Mapping) or not isinstance(data.get("tensors"), Mapping):
        raise _fail(file, "<root>", "expected {'manifest': {...}, 'tensors': {...}}")
    tensors = data["tensors"]
    bad = [k for k, v in tensors.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise _fail(file, f"tensors[{bad[0]!r}]", "expected a tensor")
    return data.get("manifest"), dict(tensors)


def load_svdquant_artifact(path: str | os.PathLike[str]) -> SVDQuantArtifact:
    """Read and check an artifact (``.json`` + ``.safetensors``, or ``.pt``).

    Raises:
        ArtifactFormatError: missing file, unknown suffix, bad schema, size/digest/dtype/shape mismatch or
            non-finite values, naming the file and the field.
    """
    p = Path(os.fspath(path))
    file = str(p)
    if not p.is_file():
        raise _fail(file, "<file>", "does not exist; create it with `worldfoundry calibrate svdquant --out ...`")
    if p.suffix == ".json":
        manifest = _read_json(p)
        entries = check_manifest(manifest, file)
        tensors = _load_safetensors(manifest, p, entries)
    elif p.suffix == ".pt":
        manifest, tensors = _load_pt(p)
        entries = check_manifest(manifest, file)
        header = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
        _check_header(file, entries, int(manifest["group_size"]), header)
    else:
        raise _fail(file, "<file>", "expected a .json manifest (with its .safetensors) or a .pt artifact")
    _check_values(file, tensors)
    return SVDQuantArtifact(file, dict(manifest), entries, tensors)


def save_svdquant_artifact(manifest: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                           out: str | os.PathLike[str]) -> Path:
    """Write an artifact; ``out`` ending in ``.pt`` writes one file, otherwise ``out`` (``.json``) and a
    ``.safetensors`` beside it. Returns the path to pass as the plugin's ``artifact`` option.

    Raises:
        ArtifactFormatError: the manifest does not pass :func:`check_manifest` (nothing is written).
    """
    p = Path(os.fspath(out))
    if p.suffix not in (".json", ".pt"):
        p = p.with_suffix(".json")
    body = dict(manifest)
    body.pop("tensors", None)
    host = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    entries = check_manifest(body, str(p))
    _check_header(str(p), entries, int(body["group_size"]), {k: (v.dtype, tuple(v.shape)) for k, v in host.items()})
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".pt":
        torch.save({"manifest": body, "tensors": host}, p)
        return p
    from safetensors.torch import save_file

    from worldfoundry.core.model_loading.file_digest import file_sha256

    tensor_path = p.with_suffix(".safetensors")
    save_file(host, str(tensor_path), metadata={"format": ARTIFACT_FORMAT})
    body["tensors"] = {"file": tensor_path.name, "size_bytes": tensor_path.stat().st_size,
                       "sha256": file_sha256(tensor_path)}
    p.write_text(json.dumps(_finite(body), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return p


def _finite(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become ``None``."""
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


__all__ = [
    "ARTIFACT_FORMAT",
    "METHODS",
    "LinearEntry",
    "SVDQuantArtifact",
    "check_manifest",
    "load_svdquant_artifact",
    "save_svdquant_artifact",
]
