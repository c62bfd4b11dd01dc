"""Steady-state CUDA-graph replay of a model's forward, per call signature (see :mod:`.runner`)."""

from __future__ import annotations

from worldfoundry.core.acceleration.cuda_graph.backends import (
    NO_CUDA_DEVICE,
    CapturedForward,
    CudaGraphBackend,
    EagerReplayBackend,
    GraphBackend,
)
from worldfoundry.core.acceleration.cuda_graph.participants import GraphCall, Participants, gather
from worldfoundry.core.acceleration.cuda_graph.runner import GraphRunner
from worldfoundry.core.acceleration.cuda_graph.signature import CallSignature, TensorSpec, call_signature
from worldfoundry.core.acceleration.cuda_graph.watch import ModelStateWatch

__all__ = [
    "NO_CUDA_DEVICE",
    "CallSignature",
    "CapturedForward",
    "CudaGraphBackend",
    "EagerReplayBackend",
    "GraphBackend",
    "GraphCall",
    "GraphRunner",
    "ModelStateWatch",
    "Participants",
    "TensorSpec",
    "call_signature",
    "gather",
]
