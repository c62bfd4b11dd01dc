"""Attention LoRA file formats: parse, validate against a model and map onto its projection modules.

Two layouts are understood; the model decides which one is expected.

**MiniMax-H3** (:class:`diffusers.MiniMaxH3Transformer3DModel`) — the original checkpoint's module names:

* ``blocks.{i}.attn.qkv_proj.lora_{A,B}.weight`` and ``blocks.{i}.attn.out_proj.lora_{A,B}.weight`` for every
  DiT block ``i < num_layers``;
* ``token_refiner.blocks.{j}.attn.{qkv_proj,out_proj}.lora_{A,B}.weight`` for every refiner block
  ``j < num_refiner_layers``;
* an optional ``diffusion_model.`` (or ``base_model.model.``) prefix and an optional PEFT ``.default`` infix
  (``lora_A.default.weight``).

The state is complete: exactly ``4 × (num_layers + num_refiner_layers)`` tensors (208 for the released
50 + 2 block configuration). ``qkv_proj.lora_A`` is ``(rank, hidden)`` and is shared by Q, K and V;
``qkv_proj.lora_B`` is ``(3 · heads · head_dim, rank)`` with its rows interleaved per head
(``[head0: q k v, head1: q k v, …]``, each piece ``head_dim`` rows). It is reordered to whole blocks
``[q_all; k_all; v_all]`` and split into the ``lora_B`` of ``to_q``/``to_k``/``to_v`` — the same reordering
diffusers' ``_convert_non_diffusers_minimax_h3_lora_to_diffusers`` applies to files written with the PEFT
``.default`` infix. ``out_proj`` maps to ``to_out.0``. Only ``transformer_blocks.*`` are adapted; the token-refiner
tensors are validated (names, shapes, dtype, values) and not applied.

**Wan** (:class:`diffusers.WanTransformer3DModel`) — diffusers/PEFT names
``blocks.{i}.{attn1,attn2}.{to_q,to_k,to_v,to_out.0}.lora_{A,B}.weight`` with an optional ``transformer.`` (or
``base_model.model.``) prefix and ``.default`` infix. Any subset of those projections may be present; every
projection present needs both tensors.

Every tensor must be a CPU FP32 tensor of finite values with the rank the caller states; any other key is
rejected by name. Nothing here changes the model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch import nn

from worldfoundry.base_models.diffusion_model.optimizations.families import (
    MINIMAX_H3,
    WAN,
    family_of,
)
from worldfoundry.errors import AccelerationRefusedError, ArtifactMismatchError

FORMAT_MINIMAX_H3: Final = "minimax_h3_attention_peft"
FORMAT_WAN: Final = "wan_attention_diffusers_peft"
#: ``qkv_proj.lora_B`` rows ``[head0: q k v, head1: q k v, ...]`` (the H3 PEFT attention state).
QKV_PER_HEAD_INTERLEAVED: Final = "per_head_interleaved"
#: ``qkv_proj.lora_B`` rows already ``[q_all; k_all; v_all]``.
QKV_BLOCKS: Final = "qkv_blocks"
QKV_LAYOUTS: Final = (QKV_PER_HEAD_INTERLEAVED, QKV_BLOCKS)

_H3_PREFIXES: Final = ("diffusion_model.", "base_model.model.")
_WAN_PREFIXES: Final = ("transformer.", "base_model.model.")
_H3_KEY: Final = re.compile(r"(blocks|token_refiner\.blocks)\.(\d+)\.attn\.(qkv_proj|out_proj)\.lora_(A|B)\.weight")
_WAN_KEY: Final = re.compile(r"blocks\.(\d+)\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)\.lora_(A|B)\.weight")


@dataclass(frozen=True)
class AdaptedProjection:
    """One projection module that receives an adapter.

    Attributes:
        path: module path in the model (``"transformer_blocks.3.attn.to_k"``).
        input_group: projections with the same ``input_group`` read the same input tensor and share the
            down step (e.g. Q/K/V of one self-attention).
        a: ``(rank, in_features)`` FP32 (for H3 Q/K/V the same tensor object, shared).
        b: ``(out_features, rank)`` FP32, already in the module's output order.
        source_keys: the ``lora_A`` and ``lora_B`` keys it came from, as written in the file.
    """

    path: str
    input_group: str
    a: torch.Tensor
    b: torch.Tensor
    source_keys: tuple[str, str]


@dataclass(frozen=True)
class AttentionLoraPlan:
    """A validated adapter, mapped onto a model. Building it changed nothing."""

    format: str
    rank: int
    qkv_layout: str | None
    projections: tuple[AdaptedProjection, ...]
    validated_only: tuple[str, ...]
    tensor_count: int
    expected_tensor_count: int | None

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(p.path for p in self.projections)

    def summary(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "rank": self.rank,
            "qkv_layout": self.qkv_layout,
            "applied_projections": len(self.projections),
            "validated_only_modules": len(self.validated_only),
            "tensor_count": self.tensor_count,
            "expected_tensor_count": self.expected_tensor_count,
        }


def minimax_h3_expected_tensor_count(num_layers: int, num_refiner_layers: int) -> int:
    """``4 × (num_layers + num_refiner_layers)``: lora_A and lora_B of qkv_proj and out_proj per block (208 for 50 + 2)."""
    return 4 * (int(num_layers) + int(num_refiner_layers))


def deinterleave_qkv_rows(b: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows ``[head0: q k v, head1: q k v, ...]`` → contiguous ``(B_q, B_k, B_v)``, each ``(heads·head_dim, rank)``.

    Args:
        b: ``(3·heads·head_dim, rank)``.
        heads: number of attention heads.
        head_dim: rows per head and per Q/K/V piece.

    Returns:
        ``(B_q, B_k, B_v)`` with head ``h``'s rows at ``h·head_dim … (h+1)·head_dim``.

    Raises:
        ValueError: the row count is not ``3·heads·head_dim``.
    """
    if b.dim() != 2 or b.shape[0] != 3 * heads * head_dim:
        raise ValueError(f"expected {3 * heads * head_dim} rows (3 × {heads} heads × {head_dim}), got {tuple(b.shape)}")
    per_head = b.reshape(heads, 3, head_dim, b.shape[1])
    return tuple(per_head[:, i].reshape(heads * head_dim, b.shape[1]).contiguous() for i in range(3))  # type: ignore[return-value]


def interleave_qkv_rows(b_q: torch.Tensor, b_k: torch.Tensor, b_v: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of :func:`deinterleave_qkv_rows` (how the H3 checkpoint lays out its fused QKV rows)."""
    rank = b_q.shape[1]
    pieces = [x.reshape(heads, -1, rank) for x in (b_q, b_k, b_v)]
    return torch.stack(pieces, dim=1).reshape(-1, rank).contiguous()


def _normalize_key(key: str, prefixes: tuple[str, ...]) -> str:
    for prefix in prefixes:
        if key.startswith(prefix):
            key = key[len(prefix):]
            break
    return key.replace(".lora_A.default.weight", ".lora_A.weight").replace(".lora_B.default.weight", ".lora_B.weight")


def _index_keys(state: Mapping[str, Any], pattern: re.Pattern[str], prefixes: tuple[str, ...],
                expected: str) -> dict[str, str]:
    """``{normalized key: key as written}``; unknown and duplicate keys raise naming the key."""
    if not isinstance(state, Mapping):
        raise ArtifactMismatchError(f"an adapter state must be a mapping of key -> tensor, got {type(state).__name__}")
    if not state:
        raise ArtifactMismatchError("the adapter state is empty")
    found: dict[str, str] = {}
    for key in state:
        if not isinstance(key, str):
            raise ArtifactMismatchError(f"{key!r}: adapter keys must be strings")
        normalized = _normalize_key(key, prefixes)
        if pattern.fullmatch(normalized) is None:
            raise ArtifactMismatchError(f"{key!r}: not an attention LoRA key of this model; expected {expected}")
        if normalized in found:
            raise ArtifactMismatchError(f"{key!r}: duplicates {found[normalized]!r} (same module after removing prefix/infix)")
        found[normalized] = key
    return found


def _check_tensor(key: str, value: Any, shape: tuple[int, int], rank: int, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ArtifactMismatchError(f"{key!r}: expected a tensor, got {type(value).__name__}")
    if value.dtype != torch.float32:
        raise ArtifactMismatchError(f"{key!r}: dtype {value.dtype}; the adapter must be float32 (convert with .float())")
    if value.device.type != "cpu":
        raise ArtifactMismatchError(f"{key!r}: on {value.device}; pass the adapter state on the CPU")
    if value.dim() != 2:
        raise ArtifactMismatchError(f"{key!r}: expected a 2-D {what} matrix, got shape {tuple(value.shape)}")
    value_rank = value.shape[0] if what == "lora_A" else value.shape[1]
    if value_rank != rank:
        raise ArtifactMismatchError(f"{key!r}: rank {value_rank} in the file, but rank={rank} was given; they must match")
    if tuple(value.shape) != shape:
        raise ArtifactMismatchError(f"{key!r}: shape {tuple(value.shape)}, the model needs {shape}")
    if not bool(torch.isfinite(value).all()):
        raise ArtifactMismatchError(f"{key!r}: contains NaN or Inf values")
    return value


def _linear_features(model: nn.Module, path: str, key: str) -> tuple[int, int]:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        raise ArtifactMismatchError(f"{key!r}: the model has no module {path!r}") from None
    in_f, out_f = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if not isinstance(in_f, int) or not isinstance(out_f, int):
        raise ArtifactMismatchError(f"{key!r}: {path} is a {type(module).__name__}, not a Linear projection")
    return in_f, out_f


# ---------------------------------------------------------------------------------------------------- MiniMax-H3
def _check_h3_keys(found: Mapping[str, str], sources: Sequence[str], dit: int, refiner: int,
                   expected_count: int) -> None:
    """Every found key names an existing block, and every block's four LoRA tensors are present.

    Raises:
        ArtifactMismatchError: a block index out of range, or a missing tensor (with the expected count).
    """
    for normalized, key in found.items():
        match = _H3_KEY.fullmatch(normalized)
        limit = dit if match.group(1) == "blocks" else refiner  # type: ignore[union-attr]
        if int(match.group(2)) >= limit:  # type: ignore[union-attr]
            raise ArtifactMismatchError(
                f"{key!r}: block index {match.group(2)} is out of range; the model has {limit} such blocks"  # type: ignore[union-attr]
            )
    for source in sources:
        for module in ("qkv_proj", "out_proj"):
            for half in ("A", "B"):
                name = f"{source}.attn.{module}.lora_{half}.weight"
                if name not in found:
                    raise ArtifactMismatchError(
                        f"{name!r}: missing; a MiniMax-H3 attention adapter holds lora_A/lora_B of qkv_proj and "
                        f"out_proj for every DiT and token-refiner block: {expected_count} tensors = 4 × "
                        f"({dit} + {refiner}), found {len(found)}"
                    )


def _parse_minimax_h3(model: nn.Module, state: Mapping[str, Any], rank: int, qkv_layout: str) -> AttentionLoraPlan:
    found = _index_keys(state, _H3_KEY, _H3_PREFIXES,
                        "'[diffusion_model.]blocks.{i}.attn.{qkv_proj,out_proj}.lora_{A,B}[.default].weight' or "
                        "'token_refiner.blocks.{j}.attn...'")
    dit = [path for path, _ in MINIMAX_H3.blocks(model)]
    refiner_container = model.get_submodule(MINIMAX_H3.refiner_blocks_attribute or "")
    refiner = [f"{MINIMAX_H3.refiner_blocks_attribute}.{j}" for j in range(len(refiner_container))]
    sources = [(f"blocks.{i}", path, True) for i, path in enumerate(dit)]
    sources += [(f"token_refiner.blocks.{j}", path, False) for j, path in enumerate(refiner)]
    expected_count = minimax_h3_expected_tensor_count(len(dit), len(refiner))
    _check_h3_keys(found, [source for source, _, _ in sources], len(dit), len(refiner), expected_count)

    projections: list[AdaptedProjection] = []
    validated_only: list[str] = []
    for source, target, applied in sources:
        attn_path = f"{target}.attn"
        attn = model.get_submodule(attn_path)
        heads, head_dim = int(attn.heads), int(attn.head_dim)
        keys = {(m, h): found[f"{source}.attn.{m}.lora_{h}.weight"] for m in ("qkv_proj", "out_proj") for h in "AB"}
        q_in, q_out = _linear_features(model, f"{attn_path}.to_q", keys["qkv_proj", "A"])
        for name in ("to_k", "to_v"):
            if _linear_features(model, f"{attn_path}.{name}", keys["qkv_proj", "A"]) != (q_in, q_out):
                raise ArtifactMismatchError(f"{keys['qkv_proj', 'A']!r}: {attn_path} has unequal Q/K/V projections")
        if q_out != heads * head_dim:
            raise ArtifactMismatchError(f"{keys['qkv_proj', 'B']!r}: {attn_path} has {q_out} Q rows, not {heads}×{head_dim}")
        o_in, o_out = _linear_features(model, f"{attn_path}.to_out.0", keys["out_proj", "A"])
        qkv_a = _check_tensor(keys["qkv_proj", "A"], state[keys["qkv_proj", "A"]], (rank, q_in), rank, "lora_A")
        qkv_b = _check_tensor(keys["qkv_proj", "B"], state[keys["qkv_proj", "B"]], (3 * q_out, rank), rank, "lora_B")
        out_a = _check_tensor(keys["out_proj", "A"], state[keys["out_proj", "A"]], (rank, o_in), rank, "lora_A")
        out_b = _check_tensor(keys["out_proj", "B"], state[keys["out_proj", "B"]], (o_out, rank), rank, "lora_B")
        if not applied:
            validated_only.extend(f"{attn_path}.{n}" for n in ("to_q", "to_k", "to_v", "to_out.0"))
            continue
        if qkv_layout == QKV_PER_HEAD_INTERLEAVED:
            b_q, b_k, b_v = deinterleave_qkv_rows(qkv_b, heads, head_dim)
        else:
            b_q, b_k, b_v = (part.contiguous() for part in qkv_b.chunk(3, dim=0))
        qkv_keys = (keys["qkv_proj", "A"], keys["qkv_proj", "B"])
        group = f"{attn_path}:hidden_states"
        projections.append(AdaptedProjection(f"{attn_path}.to_q", group, qkv_a, b_q, qkv_keys))
        projections.append(AdaptedProjection(f"{attn_path}.to_k", group, qkv_a, b_k, qkv_keys))
        projections.append(AdaptedProjection(f"{attn_path}.to_v", group, qkv_a, b_v, qkv_keys))
        projections.append(AdaptedProjection(f"{attn_path}.to_out.0", f"{attn_path}.to_out.0", out_a, out_b,
                                             (keys["out_proj", "A"], keys["out_proj", "B"])))
    return AttentionLoraPlan(FORMAT_MINIMAX_H3, rank, qkv_layout, tuple(projections), tuple(validated_only),
                             len(found), expected_count)


# ---------------------------------------------------------------------------------------------------- Wan
def _parse_wan(model: nn.Module, state: Mapping[str, Any], rank: int) -> AttentionLoraPlan:
    found = _index_keys(state, _WAN_KEY, _WAN_PREFIXES,
                        "'[transformer.]blocks.{i}.{attn1,attn2}.{to_q,to_k,to_v,to_out.0}.lora_{A,B}[.default].weight'")
    num_blocks = len(WAN.blocks(model))
    modules: dict[str, dict[str, str]] = {}
    for normalized, key in found.items():
        match = _WAN_KEY.fullmatch(normalized)
        index, attn, proj, half = match.groups()  # type: ignore[union-attr]
        if int(index) >= num_blocks:
            raise ArtifactMismatchError(f"{key!r}: block index {index} is out of range; the model has {num_blocks} blocks")
        modules.setdefault(f"blocks.{index}.{attn}.{proj}", {})[half] = key
    order = {name: i for i, name in enumerate(("to_q", "to_k", "to_v", "to_out.0"))}

    def sort_key(path: str) -> tuple[int, str, int]:
        parts = path.split(".", 3)
        return int(parts[1]), parts[2], order[parts[3]]

    projections: list[AdaptedProjection] = []
    for path in sorted(modules, key=sort_key):
        halves = modules[path]
        for half in ("A", "B"):
            if half not in halves:
                other = halves["B" if half == "A" else "A"]
                raise ArtifactMismatchError(f"{other!r}: its lora_{half} partner ({path}.lora_{half}.weight) is missing")
        in_f, out_f = _linear_features(model, path, halves["A"])
        a = _check_tensor(halves["A"], state[halves["A"]], (rank, in_f), rank, "lora_A")
        b = _check_tensor(halves["B"], state[halves["B"]], (out_f, rank), rank, "lora_B")
        block, attn, proj = path.split(".", 3)[1:]
        attn_path = f"blocks.{block}.{attn}"
        if proj == "to_out.0":
            group = path
        elif attn == "attn2" and proj in ("to_k", "to_v"):
            group = f"{attn_path}:encoder_hidden_states"
        else:
            group = f"{attn_path}:hidden_states"
        projections.append(AdaptedProjection(path, group, a, b, (halves["A"], halves["B"])))
    return AttentionLoraPlan(FORMAT_WAN, rank, None, tuple(projections), (), len(found), None)


def parse_attention_lora(model: nn.Module, state: Mapping[str, Any], *, rank: int,
                         qkv_layout: str = QKV_PER_HEAD_INTERLEAVED, plugin: str = "attention_lora") -> AttentionLoraPlan:
    """Validate an attention adapter state against ``model`` and map it onto the model's projections.

    Args:
        model: a MiniMax-H3 or Wan diffusers transformer.
        state: ``{key: tensor}`` in the model family's layout (module docstring).
        rank: the rank the caller states; every tensor must have it.
        qkv_layout: row order of the H3 fused ``qkv_proj.lora_B`` (ignored for Wan).
        plugin: name used in refusal messages.

    Returns:
        The :class:`AttentionLoraPlan`.

    Raises:
        AccelerationRefusedError: the model family has no attention adapter format.
        ArtifactMismatchError: any key, count, shape, dtype, device, rank or value check fails; the message
            starts with the offending key.
        ValueError: ``qkv_layout`` or ``rank`` is invalid.
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if qkv_layout not in QKV_LAYOUTS:
        raise ValueError(f"qkv_layout must be one of {QKV_LAYOUTS}, got {qkv_layout!r}")
    family = family_of(model, plugin=plugin)
    if family is MINIMAX_H3:
        return _parse_minimax_h3(model, state, rank, qkv_layout)
    if family is WAN:
        return _parse_wan(model, state, rank)
    raise AccelerationRefusedError(plugin, f"no attention adapter format for the {family.name} family (MiniMax-H3 and Wan only)")
