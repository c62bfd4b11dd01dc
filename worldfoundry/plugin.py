"""The one module plugin authors import.

Everything a plugin needs to validate options, claim what it changes, record reversible patches, count what
ran and refuse what it cannot do lives here under stable names::

    from dataclasses import dataclass
    from typing import ClassVar
    import worldfoundry
    from worldfoundry import plugin

    @dataclass(frozen=True)
    class Options(plugin.PluginOptions):
        plugin_name: ClassVar[str] = "my_kernel"
        scale: float = plugin.option(1.0, plugin.number(min=0.0))

    def prepare(model, options, policy):
        opts = Options.from_mapping(options)
        ...
        return plugin.PreparedAcceleration(name="my_kernel", claims=frozenset({...}), activate=activate)

    @worldfoundry.hookimpl
    def register_diffusion_accelerations(register):
        register("my_kernel", prepare, options=Options)

Example:
    >>> from worldfoundry import plugin
    >>> plugin.role("offload") == plugin.ROLE_OFFLOAD
    True
"""

from __future__ import annotations

from worldfoundry import hookimpl
from worldfoundry.base_models.diffusion_model.optimizations.families import (
    FAMILIES,
    AttentionSite,
    ModelFamily,
    family_of,
    module_path,
)
from worldfoundry.base_models.diffusion_model.optimizations.refusals import (
    compiled_modules,
    diffusers_hooks,
    refuse_common,
    refuse_compiled,
    refuse_cuda_graphs,
    refuse_diffusers_hooks,
    refuse_module_hooks,
    refuse_sequence_parallel,
    refuse_training,
)
from worldfoundry.core.acceleration.context import RequestContext, current_request, current_request_id, request_scope
from worldfoundry.core.acceleration.handle import RecordedHandle
from worldfoundry.core.acceleration.installer import install_diffusion_accelerations
from worldfoundry.core.acceleration.options import (
    OptionValueError,
    PluginOptions,
    any_of,
    boolean,
    choice,
    file_path,
    integer,
    join_path,
    nested,
    number,
    option,
    optional,
    sequence_of,
    shown_value,
    string,
)
from worldfoundry.core.acceleration.patching import NOTSET, PatchRecorder
from worldfoundry.core.acceleration.prepared import (
    ROLE_APPROXIMATE_ATTENTION,
    ROLE_ATTENTION_ADAPTER,
    ROLE_FEATURE_CACHE,
    ROLE_OFFLOAD,
    ROLE_PREFIX,
    ROLE_QUANTIZATION,
    ROLE_STATIC_KV_CACHE,
    ROLE_WEIGHT_VIEW,
    ROOT_MODULE,
    AccelerationHandle,
    PreparedAcceleration,
    PrepareFactory,
    is_role,
    role,
)
from worldfoundry.core.acceleration.receipts import ExecutionLedger
from worldfoundry.core.acceleration.registry import AccelerationRegistry
from worldfoundry.core.acceleration.session import AccelerationSession, get_session
from worldfoundry.core.model_loading.policy import RuntimePolicy
from worldfoundry.errors import (
    AccelerationInstallError,
    AccelerationOptionsError,
    AccelerationRefusedError,
    ArtifactMismatchError,
    AttentionBackendError,
    InferenceViewError,
    InvalidRequestError,
    ParameterPackingError,
    RequestError,
    SessionAlreadyInstalledError,
    WorldFoundryError,
)

__all__ = [
    "FAMILIES",
    "NOTSET",
    "ROLE_APPROXIMATE_ATTENTION",
    "ROLE_ATTENTION_ADAPTER",
    "ROLE_FEATURE_CACHE",
    "ROLE_OFFLOAD",
    "ROLE_PREFIX",
    "ROLE_QUANTIZATION",
    "ROLE_STATIC_KV_CACHE",
    "ROLE_WEIGHT_VIEW",
    "ROOT_MODULE",
    "AccelerationHandle",
    "AccelerationInstallError",
    "AccelerationOptionsError",
    "AccelerationRefusedError",
    "AccelerationRegistry",
    "AccelerationSession",
    "ArtifactMismatchError",
    "AttentionBackendError",
    "AttentionSite",
    "ExecutionLedger",
    "InferenceViewError",
    "InvalidRequestError",
    "ModelFamily",
    "OptionValueError",
    "ParameterPackingError",
    "PatchRecorder",
    "PluginOptions",
    "PrepareFactory",
    "PreparedAcceleration",
    "RecordedHandle",
    "RequestContext",
    "RequestError",
    "RuntimePolicy",
    "SessionAlreadyInstalledError",
    "WorldFoundryError",
    "any_of",
    "boolean",
    "choice",
    "compiled_modules",
    "current_request",
    "current_request_id",
    "diffusers_hooks",
    "family_of",
    "file_path",
    "get_session",
    "hookimpl",
    "install_diffusion_accelerations",
    "integer",
    "is_role",
    "join_path",
    "module_path",
    "nested",
    "number",
    "option",
    "optional",
    "refuse_common",
    "refuse_compiled",
    "refuse_cuda_graphs",
    "refuse_diffusers_hooks",
    "refuse_module_hooks",
    "refuse_sequence_parallel",
    "refuse_training",
    "request_scope",
    "role",
    "sequence_of",
    "shown_value",
    "string",
]

# Attention kernels are attention providers (docs/attention.md), selected per attention type by attention_policy.
from worldfoundry.core.attention.provider_registry import (  # noqa: E402
    AttentionProviderRegistry,
    attention_provider_registry,
    register_attention_provider,
)
from worldfoundry.core.attention.providers import (  # noqa: E402
    APPROXIMATE,
    EXACT_EQUIVALENT,
    AttentionProvider,
    from_tokens_major,
)

__all__ += [
    "APPROXIMATE",
    "EXACT_EQUIVALENT",
    "AttentionProvider",
    "AttentionProviderRegistry",
    "attention_provider_registry",
    "from_tokens_major",
    "register_attention_provider",
]
