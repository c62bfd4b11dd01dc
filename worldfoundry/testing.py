"""Test helpers for accelerations: tiny seeded models of every family, their inputs, and exact-restore checks.

For this project's tests and for third-party plugin authors alike::

    from worldfoundry import testing

    model = testing.guarded(testing.tiny_wan())     # the loader's request guard, as in a pipeline
    before = testing.fingerprint(model)
    session = install_diffusion_accelerations(model, {"my_kernel": {}})
    ...
    session.uninstall()
    testing.assert_restored(model, before)      # tree, attributes, hooks, parameters, state dict, output

The fingerprint is independent of the lifecycle code (``core/acceleration/snapshot.py``): it records every
module's identity and instance attributes, the contents of every parameter / buffer / child / hook dictionary,
parameter identities, the state dict values and a forward output, so a restore check does not trust the code
it tests. Builders run under :func:`torch.random.fork_rng`: they never change the caller's random state.

Example:
    >>> import torch
    >>> from worldfoundry import testing
    >>> model = testing.tiny_wan(num_layers=1)
    >>> before = testing.fingerprint(model)
    >>> testing.assert_restored(model, before)
    >>> tuple(testing.run_model(model, testing.wan_inputs(model)).shape)
    (1, 16, 1, 4, 4)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard, get_request_guard

#: A 2-block, 2-head (× 32) Wan 2.1 transformer.
WAN_TINY: Final[Mapping[str, Any]] = dict(
    num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16, text_dim=32, freq_dim=32,
    ffn_dim=128, num_layers=2, rope_max_seq_len=64,
)
#: A 2-block SANA-Video transformer (linear self-attention, cross-attention on 64-dim captions).
SANA_VIDEO_TINY: Final[Mapping[str, Any]] = dict(
    in_channels=16, out_channels=16, num_attention_heads=2, attention_head_dim=32, num_layers=2,
    num_cross_attention_heads=2, cross_attention_head_dim=32, cross_attention_dim=64, caption_channels=32,
    sample_size=8,
)
#: A 2-block (+ 1 refiner block) MiniMax-H3 transformer.
MINIMAX_H3_TINY: Final[Mapping[str, Any]] = dict(
    num_attention_heads=2, attention_head_dim=32, hidden_size=48, num_layers=2, num_refiner_layers=1, ffn_dim=96,
    in_channels=4, audio_in_channels=8, patch_size=(1, 2, 2), text_dim=32, freq_dim=32, time_embed_hidden_dim=48,
    time_embed_dim=24, rope_freq_dim=4,
)


# ------------------------------------------------------------------------------------------------ builders
def seeded_model(cls: type[nn.Module], seed: int = 0, *, weight_scale: float | None = None,
                 dtype: torch.dtype | None = None, weight_seed: int | None = None,
                 device: torch.device | str | None = None, **config: Any) -> nn.Module:
    """``cls(**config)`` built from ``seed`` in eval mode (full configs; the ``tiny_*`` builders add tiny defaults).

    Args:
        cls: a model class, e.g. ``diffusers.WanTransformer3DModel``.
        seed: weights are a function of the seed (and the config) only.
        weight_scale: every parameter drawn from N(0, scale²); ``None`` keeps the class's initialisation.
        weight_seed: seed of that draw (``None``: the random stream continues from building with ``seed``).
        dtype: cast after building (``None``: as built, float32).
        device: build there (``None``: the CPU); e.g. ``"cuda"`` initialises a large model on the GPU.
        **config: the constructor's arguments.

    Returns:
        The model (its parameters still require grad, as diffusers builds them).
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if device is not None:
            with torch.device(device):
                model = cls(**config)
        else:
            model = cls(**config)
        if weight_scale is not None:  # diffusers zero-initialises some projections: make every tensor count
            if weight_seed is not None:
                torch.manual_seed(weight_seed)
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(torch.randn_like(p) * weight_scale)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def tiny_wan(seed: int = 0, *, weight_scale: float | None = 0.05, dtype: torch.dtype | None = None,
             weight_seed: int | None = None, device: torch.device | str | None = None, **config: Any) -> nn.Module:
    """A seeded ``WanTransformer3DModel`` (:data:`WAN_TINY` updated by ``config``) in eval mode.

    Args:
        seed: weights are a function of the seed (and the config) only.
        weight_scale: every parameter drawn from N(0, scale²); ``None`` keeps diffusers' initialisation.
        weight_seed: seed of that draw (``None``: the random stream continues from building with ``seed``).
        dtype: cast after building (``None``: float32).
        device: build there (``None``: the CPU).
        **config: overrides of :data:`WAN_TINY` (``num_layers=4``, ``image_dim=32``, ...).

    Returns:
        The model (its parameters still require grad, as diffusers builds them).
    """
    from diffusers import WanTransformer3DModel

    return seeded_model(WanTransformer3DModel, seed, weight_scale=weight_scale, dtype=dtype, weight_seed=weight_seed,
                        device=device, **{**WAN_TINY, **config})


def tiny_wan22_experts(seed: int = 0, **kwargs: Any) -> dict[str, nn.Module]:
    """The two experts of a Wan 2.2 model, ``{"high": ..., "low": ...}`` (seeds ``seed`` and ``seed + 1``).

    Install on them as one group: ``install_diffusion_accelerations(experts, spec)``.

    Args:
        **kwargs: passed to :func:`tiny_wan` for both experts.
    """
    return {"high": tiny_wan(seed, **kwargs), "low": tiny_wan(seed + 1, **kwargs)}


def tiny_sana_video(seed: int = 0, *, weight_scale: float | None = None, dtype: torch.dtype | None = None,
                    weight_seed: int | None = None, device: torch.device | str | None = None,
                    **config: Any) -> nn.Module:
    """A seeded ``SanaVideoTransformer3DModel`` (:data:`SANA_VIDEO_TINY` updated by ``config``); see :func:`tiny_wan`."""
    from diffusers import SanaVideoTransformer3DModel

    return seeded_model(SanaVideoTransformer3DModel, seed, weight_scale=weight_scale, dtype=dtype, weight_seed=weight_seed,
                        device=device, **{**SANA_VIDEO_TINY, **config})


def tiny_minimax_h3(seed: int = 0, *, weight_scale: float | None = None, dtype: torch.dtype | None = None,
                    weight_seed: int | None = None, device: torch.device | str | None = None,
                    **config: Any) -> nn.Module:
    """A seeded ``MiniMaxH3Transformer3DModel`` (:data:`MINIMAX_H3_TINY` updated by ``config``); see :func:`tiny_wan`."""
    from diffusers import MiniMaxH3Transformer3DModel

    return seeded_model(MiniMaxH3Transformer3DModel, seed, weight_scale=weight_scale, dtype=dtype, weight_seed=weight_seed,
                        device=device, **{**MINIMAX_H3_TINY, **config})


# ------------------------------------------------------------------------------------------------ inputs
def _config(model: nn.Module | Mapping[str, Any] | None, default: Mapping[str, Any]) -> Mapping[str, Any]:
    if model is None:
        return default
    return model if isinstance(model, Mapping) else model.config


def wan_inputs(model: nn.Module | Mapping[str, Any] | None = None, seed: int = 1, *, frames: int = 1, height: int = 4, width: int = 4,
               text_tokens: int = 8, timestep: float = 500, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> dict[str, Any]:
    """Seeded inputs of a Wan forward (latents, one timestep, text embeddings), shaped for ``model``'s config.

    Args:
        model: the Wan model or its config (``None``: :data:`WAN_TINY`).
        frames / height / width: the latent grid; ``text_tokens``: text rows.
        device: where the tensors go (drawn on the CPU first, so the values do not depend on it).
    """
    cfg = _config(model, WAN_TINY)
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, cfg["in_channels"], frames, height, width, generator=g).to(device, dtype),
        "timestep": torch.tensor([timestep], device=device),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg["text_dim"], generator=g).to(device, dtype),
    }


def sana_video_inputs(model: nn.Module | Mapping[str, Any] | None = None, seed: int = 1, *, frames: int = 2, height: int = 8,
                      width: int = 8, text_tokens: int = 12, padded_tokens: int = 3) -> dict[str, Any]:
    """Seeded inputs of a SANA-Video forward, the last ``padded_tokens`` text rows masked out."""
    cfg = _config(model, SANA_VIDEO_TINY)
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(1, text_tokens)
    if padded_tokens:
        mask[:, text_tokens - padded_tokens:] = 0
    return {"hidden_states": torch.randn(1, cfg["in_channels"], frames, height, width, generator=g),
            "encoder_hidden_states": torch.randn(1, text_tokens, cfg["caption_channels"], generator=g),
            "timestep": torch.tensor([500]), "encoder_attention_mask": mask}


def minimax_h3_inputs(model: nn.Module | Mapping[str, Any] | None = None, seed: int = 1, *, text_rows: int = 3, audio_rows: int = 2,
                      dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """A packed H3 sequence: ``text_rows`` text rows, 8 video rows (2 frames of 2 × 2 patches), audio rows."""
    cfg = _config(model, MINIMAX_H3_TINY)
    patch_size = cfg["patch_size"]
    g = torch.Generator().manual_seed(seed)
    v_rows = 8
    s = text_rows + v_rows + audio_rows
    patch = cfg["in_channels"] * patch_size[0] * patch_size[1] * patch_size[2]
    frame = torch.arange(2).repeat_interleave(4)
    pos = torch.cat([
        torch.stack([torch.zeros(text_rows), torch.zeros(text_rows), torch.arange(text_rows)], 1),
        torch.stack([frame, torch.arange(2).repeat_interleave(2).repeat(2), torch.arange(2).repeat(4)], 1).float(),
        torch.stack([torch.arange(audio_rows), torch.zeros(audio_rows), torch.zeros(audio_rows)], 1),
    ]).long()
    return {
        "hidden_states": torch.randn(1, v_rows, patch, generator=g).to(dtype),
        "audio_hidden_states": torch.randn(1, audio_rows, cfg["audio_in_channels"], generator=g).to(dtype),
        "encoder_hidden_states": torch.randn(1, text_rows, cfg["text_dim"], generator=g).to(dtype),
        "timestep": torch.tensor([0.6]),
        "timestep_indices": torch.zeros(s, dtype=torch.long),
        "token_tags": torch.cat([torch.ones(text_rows), torch.zeros(v_rows), torch.full((audio_rows,), 2.0)]).long(),
        "position_ids": pos,
        "video_indices": torch.arange(text_rows, text_rows + v_rows),
        "audio_indices": torch.arange(text_rows + v_rows, s),
        "text_indices": torch.arange(text_rows),
    }


def run_model(model: nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
    """``model(**inputs, return_dict=False)[0]`` without autograd."""
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def run_request(model: nn.Module, request_id: str, call: Callable[[int, str], torch.Tensor], *, steps: int,
                branches: tuple[str, ...] = ("cond", "uncond"), timestep: Callable[[int], float] | None = None,
                before_step: Callable[[int], None] | None = None) -> list[torch.Tensor]:
    """Drive one request the way a pipeline does: ``steps`` × ``branches`` calls of ``call(step, branch)``.

    The model's request guard (attached when missing) owns ``request_id`` for the whole request, and every call
    runs inside a request scope naming the request, CFG branch, step and timestep.

    Args:
        model: the model (or one expert of a guarded group).
        call: one forward; its result is collected.
        timestep: ``step -> timestep`` recorded in the context (default ``1000 - step``).
        before_step: called with the step's index before its calls.

    Returns:
        The outputs in call order.
    """
    guard = get_request_guard(model) or attach_request_guard(model)
    outputs = []
    with guard.request(request_id):
        for step in range(steps):
            if before_step is not None:
                before_step(step)
            t = float(timestep(step)) if timestep is not None else 1000.0 - step
            for branch in branches:
                with request_scope(RequestContext(request_id, branch, step, t, None, steps)):
                    outputs.append(call(step, branch))
    return outputs


# ------------------------------------------------------------------------------------------------ fingerprints
_HOOK_DICTS: Final = (
    "_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_always_called",
    "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


@dataclass
class ModelFingerprint:
    """What :func:`fingerprint` recorded (compare two with :func:`assert_same_model`)."""

    modules: list[tuple[str, int, str]]
    attrs: dict[str, dict[str, int]]
    dicts: dict[str, dict[str, list[tuple[Any, int]]]]
    non_persistent: dict[str, frozenset[str]]
    param_ids: dict[str, int]
    state: dict[str, torch.Tensor]
    output: torch.Tensor | None
    forward: Callable[[nn.Module], torch.Tensor] | None = None


def default_forward(model: nn.Module) -> torch.Tensor:
    """The forward a fingerprint records for a Wan model: :func:`wan_inputs` (seed 1) through ``model``."""
    return run_model(model, wan_inputs(model))


def fingerprint(model: nn.Module, *, forward: Callable[[nn.Module], torch.Tensor] | bool | None = True
                ) -> ModelFingerprint:
    """Record ``model``'s module tree, attributes, hook and parameter dictionaries, state dict and an output.

    Args:
        model: any ``nn.Module``.
        forward: ``True``: :func:`default_forward` (a Wan forward); a callable ``model -> Tensor``: that
            forward; ``False``/``None``: no output.

    Returns:
        A :class:`ModelFingerprint` (state dict values cloned).
    """
    run = default_forward if forward is True else (forward or None)
    modules, attrs, dicts, non_persistent = [], {}, {}, {}
    for name, module in model.named_modules(remove_duplicate=False):
        key = name or "<root>"
        modules.append((key, id(module), type(module).__qualname__))
        attrs[key] = {k: id(v) for k, v in module.__dict__.items() if k not in _HOOK_DICTS}
        dicts[key] = {k: [(hk, id(hv)) for hk, hv in module.__dict__[k].items()]
                      for k in _HOOK_DICTS if k in module.__dict__}
        non_persistent[key] = frozenset(module._non_persistent_buffers_set)
    return ModelFingerprint(
        modules=modules, attrs=attrs, dicts=dicts, non_persistent=non_persistent,
        param_ids={n: id(p) for n, p in model.named_parameters(remove_duplicate=False)},
        state={k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        output=run(model) if run is not None else None, forward=run,
    )


def _expect(condition: object, message: str) -> None:
    """``AssertionError(message)`` unless ``condition`` (kept under ``python -O``, unlike ``assert``)."""
    if not condition:
        raise AssertionError(message)


def assert_same_model(before: ModelFingerprint, after: ModelFingerprint) -> None:
    """Module tree, attributes, hooks, parameter identities, state dict values and output: all identical.

    Raises:
        AssertionError: naming the first difference.
    """
    _expect(after.modules == before.modules, "module tree changed")
    for key in before.attrs:
        added = sorted(set(after.attrs[key]) - set(before.attrs[key]))
        removed = sorted(set(before.attrs[key]) - set(after.attrs[key]))
        changed = sorted(k for k in before.attrs[key]
                         if k in after.attrs[key] and after.attrs[key][k] != before.attrs[key][k])
        _expect(not (added or removed or changed), f"{key}: attributes added {added} removed {removed} changed {changed}")
        _expect(after.dicts[key] == before.dicts[key], f"{key}: parameter/buffer/module/hook dictionaries changed")
        _expect(after.non_persistent[key] == before.non_persistent[key], f"{key}: non-persistent buffer set changed")
    _expect(after.param_ids == before.param_ids, "parameter identities changed")
    _expect(list(after.state) == list(before.state), "state dict keys changed")
    for k, v in before.state.items():
        _expect(after.state[k].dtype == v.dtype and torch.equal(after.state[k], v), f"state dict value {k} changed")
    if before.output is not None and after.output is not None:
        _expect(torch.equal(after.output, before.output), "forward output is not bitwise identical")


def assert_restored(model: nn.Module, before: ModelFingerprint) -> None:
    """``model`` is exactly what ``before`` recorded (the same forward is run again when one was recorded).

    Fingerprint a model after :func:`guarded` (the request guard the loader attaches stays by design).

    Raises:
        AssertionError: naming the first difference.
    """
    assert_same_model(before, fingerprint(model, forward=before.forward if before.output is not None else None))


class OpRecorder(TorchDispatchMode):
    """Records the aten ops that actually run inside it (a backend's kernel, or the math decomposition).

    Example:
        >>> import torch
        >>> from worldfoundry.testing import OpRecorder
        >>> with OpRecorder() as rec:
        ...     _ = torch.ones(2) + 1
        >>> "aten.add.Tensor" in rec.ops
        True
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def guarded(model: nn.Module | Mapping[str, nn.Module]) -> nn.Module | Mapping[str, nn.Module]:
    """Attach the request guard the loader gives every DiT (one guard for all experts of a mapping).

    The installer attaches one to a model that has none, and it stays after uninstall (it belongs to the
    model, not to a session): guard a model before taking its :func:`fingerprint`.

    Returns:
        ``model``.
    """
    models = list(model.values()) if isinstance(model, Mapping) else [model]
    guard = attach_request_guard(models[0])
    for other in models[1:]:
        attach_request_guard(other, guard)
    return model


__all__ = [
    "MINIMAX_H3_TINY",
    "SANA_VIDEO_TINY",
    "WAN_TINY",
    "ModelFingerprint",
    "OpRecorder",
    "assert_restored",
    "assert_same_model",
    "default_forward",
    "fingerprint",
    "guarded",
    "minimax_h3_inputs",
    "run_model",
    "run_request",
    "sana_video_inputs",
    "seeded_model",
    "tiny_minimax_h3",
    "tiny_sana_video",
    "tiny_wan",
    "tiny_wan22_experts",
    "wan_inputs",
]
