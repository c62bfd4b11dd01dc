"""Typed errors. Every message says what went wrong and what to do about it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class WorldFoundryError(Exception):
    """Base class of every error raised by worldfoundry."""


# --- configuration and options -------------------------------------------------------------------


class PolicyError(WorldFoundryError, ValueError):
    """A :class:`RuntimePolicy` field or option is invalid."""


class AccelerationOptionsError(WorldFoundryError, ValueError):
    """The options given to one acceleration are invalid (unknown key, wrong type, out of range)."""

    def __init__(self, plugin: str, message: str, *, path: str | None = None) -> None:
        self.plugin = plugin
        #: JSON path of the bad value when known (``accelerations.easycache.threshold``).
        self.path = path
        super().__init__(f"{plugin}: {message}")


# --- registry ------------------------------------------------------------------------------------


class UnknownAccelerationError(WorldFoundryError, KeyError):
    """An acceleration name is not registered."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(name)

    def __str__(self) -> str:
        known = ", ".join(self.known) if self.known else "(none registered)"
        return (
            f"unknown acceleration {self.name!r}; known accelerations: {known}. "
            "Install the plugin distribution or check WORLDFOUNDRY_PLUGINS."
        )


class DuplicateAccelerationError(WorldFoundryError, ValueError):
    """A name is registered twice without ``replace=True``."""


class PluginLoadError(WorldFoundryError, RuntimeError):
    """A plugin distribution failed to load; other plugins are unaffected."""

    def __init__(self, distribution: str, entry_point: str, cause: BaseException) -> None:
        self.distribution = distribution
        self.entry_point = entry_point
        self.cause = cause
        super().__init__(
            f"plugin {entry_point!r} from distribution {distribution!r} failed to load: "
            f"{type(cause).__name__}: {cause}"
        )


# --- lifecycle -----------------------------------------------------------------------------------


class ModelBusyError(WorldFoundryError, RuntimeError):
    """The model is running a request (or being modified); changes are refused."""

    def __init__(self, action: str, request_ids: Sequence[str] = (), active_forwards: int = 0,
                 mutating: bool = False) -> None:
        self.action = action
        self.request_ids = tuple(request_ids)
        self.active_forwards = active_forwards
        self.mutating = mutating
        parts = []
        if self.request_ids:
            parts.append("active request ids: " + ", ".join(repr(r) for r in self.request_ids))
        if active_forwards:
            parts.append(f"{active_forwards} forward call(s) in flight")
        if mutating:
            parts.append("an install/uninstall is in progress")
        detail = "; ".join(parts) or "busy"
        super().__init__(f"cannot {action}: the model is busy ({detail}). Wait for the request(s) to end first.")


class SessionAlreadyInstalledError(WorldFoundryError, RuntimeError):
    """A model already carries an acceleration session."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        super().__init__(
            "the model already has an acceleration session "
            f"({', '.join(self.names) or 'empty'}); call model._worldfoundry_accelerations.uninstall() first."
        )


class AccelerationConflictError(WorldFoundryError, ValueError):
    """Two accelerations claim the same module/role, or one declares the other incompatible."""

    def __init__(self, first: str, second: str, resource: str, reason: str = "both claim") -> None:
        self.first = first
        self.second = second
        self.resource = resource
        super().__init__(
            f"accelerations {first!r} and {second!r} conflict: {reason} {resource!r}. "
            "Remove one of them from the spec."
        )


class AccelerationRefusedError(WorldFoundryError, ValueError):
    """An acceleration cannot be applied to this model in its current state (named reason)."""

    def __init__(self, plugin: str, reason: str) -> None:
        self.plugin = plugin
        self.reason = reason
        super().__init__(f"{plugin} refused: {reason}")


class AccelerationInstallError(WorldFoundryError, RuntimeError):
    """Activation failed; everything activated before was rolled back. ``__cause__`` holds the original error."""

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        super().__init__(f"installing {name!r} failed and was rolled back: {message}")


class AccelerationRestoreError(WorldFoundryError, RuntimeError):
    """Undoing one or more recorded patches failed. The remaining patches were still undone."""

    def __init__(self, errors: Sequence[BaseException]) -> None:
        self.errors = tuple(errors)
        lines = "; ".join(f"{type(e).__name__}: {e}" for e in self.errors)
        super().__init__(f"{len(self.errors)} patch(es) failed to undo: {lines}")


class OwnershipCollisionError(WorldFoundryError, RuntimeError):
    """Uninstall would overwrite or remove something that was changed after install (by the user or another
    library). Nothing was changed; ``.collisions`` lists each one."""

    def __init__(self, collisions: Sequence[str]) -> None:
        self.collisions = tuple(collisions)
        listed = "; ".join(self.collisions[:10])
        if len(self.collisions) > 10:
            listed += f"; ... ({len(self.collisions)} in all)"
        super().__init__(
            f"uninstall refused, nothing was changed: {len(self.collisions)} change(s) made after install sit on "
            f"top of what uninstall must undo: {listed}. Undo those changes first (e.g. disable_cache(), "
            "remove_all_hooks(), unfuse_qkv_projections(), unload_lora_weights()), uninstall, then apply them again"
        )


class InferenceViewError(WorldFoundryError, RuntimeError):
    """A weight-changing acceleration is active; the requested operation needs the canonical model."""


class RequestError(WorldFoundryError, ValueError):
    """A request id is used twice, ended without being begun, or a schedule is malformed."""


# --- model layer ---------------------------------------------------------------------------------


class UnknownRecipeError(WorldFoundryError, KeyError):
    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(name)

    def __str__(self) -> str:
        return f"unknown recipe {self.name!r}; known recipes: {', '.join(self.known)}"


class RecipeError(WorldFoundryError, ValueError):
    """A recipe file is malformed."""


class MissingWeightsError(WorldFoundryError, FileNotFoundError):
    """A component's weights were not found in any of the places looked at."""

    def __init__(self, recipe: str, component: str, looked_at: Sequence[str], hint: str = "") -> None:
        self.recipe = recipe
        self.component = component
        self.looked_at = tuple(looked_at)
        where = "\n  ".join(self.looked_at) if self.looked_at else "(nowhere)"
        super().__init__(
            f"recipe {recipe!r}: weights for component {component!r} not found. Looked at:\n  {where}\n"
            + (hint or "Pass checkpoint_dir=<local diffusers-format directory> or --random-weights.")
        )


class CheckpointError(WorldFoundryError, ValueError):
    """A checkpoint file is corrupt or has unexpected keys/shapes."""


class ArtifactMismatchError(WorldFoundryError, ValueError):
    """An artifact (calibration, bundle, adapter) does not match the model or checkpoint it is used with."""


class InvalidRequestError(WorldFoundryError, ValueError):
    """A generation request has invalid fields (frame count, size, steps, ...)."""


class CandidateSchemaError(WorldFoundryError, ValueError):
    """A benchmark candidate file does not match the documented schema. The message names the JSON path."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}")


class PipelineClosedError(WorldFoundryError, RuntimeError):
    """The pipeline was closed; build a new one."""


class UnsupportedCodecOptionError(WorldFoundryError, ValueError):
    """A video codec option (build purpose, precision, tiling, offload, ...) is not supported; ``.option`` names it."""

    def __init__(self, option: str, reason: str) -> None:
        self.option = option
        self.reason = reason
        super().__init__(f"video codec option {option!r} refused: {reason}")


class QuantizationInputError(WorldFoundryError, ValueError):
    """A tensor handed to a quantization routine has an unsupported dtype, shape, layout or device."""


# --- attention -----------------------------------------------------------------------------------


class AttentionBackendError(WorldFoundryError, RuntimeError):
    """PyTorch cannot run scaled-dot-product attention with the explicitly requested backend.

    Raised instead of letting PyTorch fall back to another kernel, so a backend choice is never silently ignored.
    """

    def __init__(self, backend: str, reason: str) -> None:
        self.backend = backend
        self.reason = reason
        super().__init__(
            f"SDPA backend {backend!r} cannot run these inputs: {reason}. "
            "Choose another sdpa_backend (\"torch\" lets PyTorch pick) or change the inputs' dtype/device/shape."
        )


class ParameterPackingError(WorldFoundryError, ValueError):
    """Parameters cannot be packed into one shared storage (tied, quantized, non-float, mixed dtype/device, ...)."""


class OffloadScheduleError(WorldFoundryError, RuntimeError):
    """Block offloading broke its copy/compute ordering (e.g. waited on an event that was never recorded)."""
