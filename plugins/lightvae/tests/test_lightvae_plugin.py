"""The ``lightvae`` acceleration: options, registration, receipts counting real execution, CPU fallback,
exact restore, refusals, conflicts and the calibration command.

Numerical tolerance against the dense FP32 encoder (random weights, 1x3x5x16x16 clip): latent relative L2
below 0.1 (about 0.02 measured). The ``scaled_mm`` and ``reference`` backends agree per convolution to 1e-5
(``tests/core/acceleration/quantization/test_fp8_conv.py``); through 26 chained FP8 convolutions their
summation-order differences move some inputs across FP8 rounding boundaries, so end to end they are only
required to agree within 0.05 relative L2 (about 0.014 measured).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import pytest
import torch
from worldfoundry_lightvae.options import Options
from worldfoundry_lightvae.plugin import prepare

from worldfoundry import testing
from worldfoundry.base_models.diffusion_model.codec import (
    install_fp8_encoder,
    load_wan_video_codec,
    random_wan_video_codec,
)
from worldfoundry.base_models.diffusion_model.codec_checkpoints import (
    to_original_state_dict,
)
from worldfoundry.base_models.diffusion_model.codec_fp8 import (
    calibrate_encoder_fp8,
    causal_convolutions,
    save_artifact,
)
from worldfoundry.core.acceleration.context import RequestContext, request_scope
from worldfoundry.core.acceleration.guard import attach_request_guard, get_request_guard
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.prepared import (
    ROLE_QUANTIZATION,
    PreparedAcceleration,
)
from worldfoundry.core.acceleration.quantization.fp8_conv import (
    scaled_mm_unavailable_reason,
)
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import (
    AccelerationConflictError,
    AccelerationOptionsError,
    AccelerationRefusedError,
    InferenceViewError,
    ModelBusyError,
)

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks" / "inference"


def _clip(seed: int) -> torch.Tensor:
    return torch.rand(1, 3, 5, 16, 16, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _registry() -> AccelerationRegistry:
    reg = AccelerationRegistry(discover=False)
    reg.register("lightvae", prepare)
    return reg


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lightvae")
    ckpt = root / "lightvaew2_1.pth"
    torch.save(to_original_state_dict(random_wan_video_codec("lightvae-wan21", seed=9).module.state_dict()), ckpt)
    codec = load_wan_video_codec(ckpt, "lightvae-wan21", device="cpu")
    artifact = calibrate_encoder_fp8(codec, [("c11", _clip(11))], frames=5)
    path = save_artifact(artifact, root / "lightvae-fp8.pt")
    video = _clip(42)
    return {"ckpt": ckpt, "artifact": path, "codec": codec, "video": video, "dense": codec.encode(video)}


@pytest.fixture
def fp8(files: dict):
    """Install the FP8 encoder on the shared codec with a backend; uninstalled after the test."""
    codec = files["codec"]

    def install(backend: str):
        codec.fp8_session = install_fp8_encoder(codec, files["artifact"], backend=backend, registry=_registry())
        return codec

    yield install
    codec.close()


# ------------------------------------------------------------------------------------------- options, registry


@pytest.mark.parametrize("options, match", [
    ({}, "calibration: the path of an FP8 calibration artifact is required"),
    ({"calibration": "a.pt", "threshold": 1}, r"unknown option\(s\) \['threshold'\]"),
    ({"calibration": "a.pt", "backend": "triton"}, "backend: expected one of"),
    ({"calibration": "a.pt", "count_clipping": 1}, "count_clipping"),
    ({"calibration": "a.pt", "checkpoint_sha256": "abc"}, "checkpoint_sha256"),
    ({"calibration": "a.pt", "workspace_mb": 0}, "workspace_mb"),
])
def test_options_are_validated(options, match):
    with pytest.raises(AccelerationOptionsError, match=match):
        Options.from_mapping(options)


def test_entry_point_registers_lightvae():
    reg = AccelerationRegistry(discover=True, allowlist=["lightvae"])
    entry = reg.get("lightvae")
    assert entry.distribution == "worldfoundry-lightvae" and entry.factory is prepare


# ------------------------------------------------------------------------------------------- execution


def test_loader_installs_the_fp8_encoder(files):
    codec = load_wan_video_codec(files["ckpt"], "lightvae-wan21", device="cpu", fp8_calibration=files["artifact"],
                                 fp8_backend="reference", registry=_registry())
    plugin = codec.fp8_session.receipt.plugins[0]
    assert plugin.options["checkpoint_sha256"] == codec.source.sha256 is not None
    assert codec.execution_report()["fp8_encoder"]["installed"]["names"] == ["lightvae"]
    codec.close()
    assert codec.fp8_session is None


def test_reference_backend_counts_every_convolution_in_the_request(files, fp8):
    codec = fp8("reference")
    session = codec.fp8_session
    receipt = session.receipt.to_json()
    plugin = receipt["plugins"][0]
    paths = [p.removeprefix("encoder.") for p, _ in causal_convolutions(codec.module.encoder)]
    assert set(plugin["claims"]) == set(paths) | {ROLE_QUANTIZATION}
    assert plugin["exact"] is False and receipt["execution_verified"] is False
    assert plugin["options"]["algorithmically_approximate"] is True
    assert plugin["options"]["resolved_backend"] == "reference"
    guard = get_request_guard(codec.module.encoder)
    with guard.request("r1"), request_scope(RequestContext("r1")):
        latents = codec.encode(files["video"])
        session.execution_report()  # a report in the middle of a request keeps the clipping totals whole
        codec.encode(files["video"])
    report = session.execution_report()["plugins"]["lightvae"]["model"]
    r1 = report["requests"]["r1"]
    assert set(r1["modules"]) == set(paths)
    assert all(r1["modules"][p]["fp8_reference"] >= 2 for p in paths)
    assert r1["counters"].get("dense_fallback", 0) == 0 and r1["finished"] is True
    assert r1["counters"]["fp8_reference"] == 100  # 2 encodes x (26 convolutions x 2 chunks - 2 first-chunk time_convs)
    clipping = r1["notes"]["input_clipping"]
    assert set(clipping) == set(paths)
    assert clipping["conv_in"]["elements"] == 2 * 3 * (3 * 18 * 18 + 6 * 18 * 18)  # padded chunks of 1 and 4 frames
    assert sum(v["clipped"] for v in clipping.values()) == r1["counters"].get("clipped_inputs", 0)
    assert report["algorithmically_approximate"] is True and report["packed_weight_bytes"] > 0
    assert _rel_l2(latents, files["dense"]) < 0.1


@pytest.mark.skipif(scaled_mm_unavailable_reason("cpu") is not None, reason="no FP8 _scaled_mm on this CPU build")
def test_scaled_mm_backend_matches_the_reference_backend(files, fp8):
    codec = fp8("reference")
    b = codec.encode(files["video"])
    codec.close()
    codec = fp8("scaled_mm")
    a = codec.encode(files["video"])
    assert _rel_l2(a, b) < 0.05
    assert _rel_l2(a, files["dense"]) < 0.1
    totals = codec.fp8_session.execution_report()["plugins"]["lightvae"]["model"]["totals"]
    assert totals["fp8_scaled_mm"] == 50 and "dense_fallback" not in totals
    assert any("numerics check" in n for n in codec.fp8_session.receipt.plugins[0].notes)


def test_cpu_auto_backend_is_a_visible_fallback(files, fp8):
    codec = fp8("auto")
    plugin = codec.fp8_session.receipt.plugins[0]
    assert plugin.options["resolved_backend"] == "fallback"
    assert "cpu" in plugin.options["fallback_reason"]
    assert any("dense FP32 fallback" in n for n in plugin.notes)
    latents = codec.encode(files["video"])
    assert torch.equal(latents, files["dense"])
    report = codec.fp8_session.execution_report()["plugins"]["lightvae"]["model"]
    request = report["requests"]["<no-request>"]
    assert request["counters"]["dense_fallback"] == 50 and not request["modules"]
    assert list(request["fallbacks"]) == [plugin.options["fallback_reason"]]
    assert len(request["module_fallbacks"]) == 26


# ------------------------------------------------------------------------------------------- lifecycle


def test_uninstall_restores_the_encoder_exactly(files, fp8):
    before = {k: v.clone() for k, v in files["codec"].module.state_dict().items()}
    codec = fp8("reference")
    encoder = codec.module.encoder
    attributes = {name: dict(m.__dict__) for name, m in encoder.named_modules()}
    convs = causal_convolutions(encoder)
    original_signature = inspect.signature(torch.nn.Conv3d._conv_forward.__get__(convs[0][1]))
    assert inspect.signature(convs[0][1]._conv_forward) == original_signature
    assert all("_conv_forward" in m.__dict__ for _, m in convs)
    codec.close()
    assert not any("_conv_forward" in m.__dict__ for _, m in convs)
    assert codec.fp8_session is None and "_worldfoundry_accelerations" not in encoder.__dict__
    for name, module in encoder.named_modules():
        current = {k: v for k, v in module.__dict__.items() if k not in ("_worldfoundry_guard", "_apply")}
        saved = {k: v for k, v in attributes[name].items()
                 if k not in ("_conv_forward", "_worldfoundry_accelerations", "_worldfoundry_guard", "_apply",
                              "__deepcopy__", "__reduce_ex__")}
        assert current.keys() == saved.keys() and all(current[k] is saved[k] or current[k] == saved[k] for k in saved)
    assert all(torch.equal(v, before[k]) for k, v in codec.module.state_dict().items())
    assert torch.equal(codec.encode(files["video"]), files["dense"])
    codec.close()  # idempotent


def test_weight_edits_while_active_are_refused(files, fp8):
    codec = fp8("reference")
    with torch.no_grad():
        codec.module.encoder.conv_in.weight.mul_(1.0)
    with pytest.raises(InferenceViewError, match="uninstall first"):
        codec.encode(files["video"])


def test_install_and_uninstall_are_refused_while_busy(files, fp8):
    codec = fp8("reference")
    guard = get_request_guard(codec.module.encoder)
    guard.begin_request("busy")
    try:
        with pytest.raises(ModelBusyError, match="busy"):
            codec.close()
        assert codec.fp8_session is not None and codec.fp8_session.installed
    finally:
        guard.end_request("busy")
    codec.close()
    assert get_request_guard(codec.module.encoder) is None  # the guard the install attached left with it
    guard = attach_request_guard(codec.module.encoder)
    guard.begin_request("busy-2")
    try:
        with pytest.raises(ModelBusyError, match="busy-2"):
            fp8("reference")
    finally:
        guard.end_request("busy-2")


def test_quantization_role_conflicts_are_found_before_activation(files):
    encoder = files["codec"].module.encoder
    reg = _registry()
    activated = []

    def other(model, options, policy):
        return PreparedAcceleration("other_fp8", frozenset({ROLE_QUANTIZATION}), lambda: activated.append(1))

    reg.register("other_fp8", other)
    with pytest.raises(AccelerationConflictError, match="'lightvae' and 'other_fp8'|'other_fp8' and 'lightvae'"):
        install_diffusion_accelerations(encoder, {"lightvae": {"calibration": str(files["artifact"])},
                                                  "other_fp8": {}}, registry=reg)
    assert not activated and not any("_conv_forward" in m.__dict__ for _, m in causal_convolutions(encoder))


def test_prepare_refuses_other_models(files):
    tiny_wan = testing.tiny_wan(weight_scale=None, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
                                freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=16)
    policy = RuntimePolicy()
    options = {"calibration": str(files["artifact"])}
    with pytest.raises(AccelerationRefusedError, match="not a Wan VAE encoder"):
        prepare(tiny_wan, options, policy)
    teacher_like = random_wan_video_codec("lightvae-wan21", seed=9).module.encoder
    teacher_like.conv_in = torch.nn.Conv3d(3, 96, 3)
    with pytest.raises(AccelerationRefusedError, match="base_dim 96"):
        prepare(teacher_like, options, policy)
    training = random_wan_video_codec("lightvae-wan21", seed=9).module.encoder.train()
    with pytest.raises(AccelerationRefusedError, match="training mode"):
        prepare(training, options, policy)


# ------------------------------------------------------------------------------------------- calibration command


def test_calibrate_plugins_lightvae_fp8_command(files, tmp_path):
    torch.save(_clip(11), tmp_path / "calibration_11.pt")
    torch.save(_clip(12), tmp_path / "calibration_12.pt")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("calibrate_plugins_under_test", BENCHMARKS / "calibrate_plugins.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
        sys.modules.pop("calibrate_plugins_under_test", None)
    out = tmp_path / "out" / "lightvae-fp8.pt"
    summary = module.main(["lightvae_fp8", "--checkpoint", str(files["ckpt"]), "--reference",
                           str(tmp_path / "calibration_11.pt"), str(tmp_path / "calibration_12.pt"),
                           "--include", "encoder.down_blocks.*", "--frames", "5", "--device", "cpu", "--out", str(out)])
    assert out.is_file() and (out.parent / "lightvae-fp8.json").is_file()
    assert all(p.startswith("encoder.down_blocks.") for p in summary["convolutions"])
    assert "lightvae_fp8" in module.CALIBRATIONS
    codec = files["codec"]
    codec.fp8_session = install_fp8_encoder(codec, out, backend="reference", registry=_registry())
    try:
        assert codec.fp8_session.receipt.plugins[0].options["convolutions"] == len(summary["convolutions"]) == 20
    finally:
        codec.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_backend_runs_fp8_on_every_convolution(files):
    from worldfoundry.core.acceleration.quantization.fp8_conv import (
        fp8_gemm_unavailable_reason,
    )

    if fp8_gemm_unavailable_reason("cuda") is not None:
        pytest.skip("the GPU has no FP8 tensor cores")
    dense = load_wan_video_codec(files["ckpt"], "lightvae-wan21", device="cuda")
    codec = load_wan_video_codec(files["ckpt"], "lightvae-wan21", device="cuda", fp8_calibration=files["artifact"],
                                 registry=_registry())
    video = files["video"].cuda()
    with request_scope(RequestContext("gpu")):
        latents = codec.encode(video)
    request = codec.fp8_session.execution_report()["plugins"]["lightvae"]["model"]["requests"]["gpu"]
    assert request["counters"]["fp8_scaled_mm"] == 50 and "dense_fallback" not in request["counters"]
    assert _rel_l2(latents, dense.encode(video)) < 0.1
    codec.close()
