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

    def __init__(self, name: str, known: Iterable[str], *, distribution: str | None = None,
                 skipped_by_allowlist: bool = False) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        #: the distribution that provides ``name`` when it is a built-in plugin (``worldfoundry-easycache``).
        self.distribution = distribution
        #: an installed entry point of that name was skipped by ``WORLDFOUNDRY_PLUGINS``.
        self.skipped_by_allowlist = skipped_by_allowlist
        super().__init__(name)

    def __str__(self) -> str:
        known = ", ".join(self.known) if self.known else "(none registered)"
        head = f"unknown acceleration {self.name!r}; known accelerations: {known}. "
        if self.skipped_by_allowlist:
            return head + f"It is installed but not in WORLDFOUNDRY_PLUGINS: add {self.name!r} there or unset it."
        if self.distribution is not None:
            return head + (
                f"It is provided by the distribution {self.distribution!r}, which is not installed: install it "
                f"(pip install {self.distribution}, or every built-in plugin with pip install \"worldfoundry[all]\"; "
                "from a checkout, see the README's Install section)."
            )
        return head + "Install the distribution that provides it, or check WORLDFOUNDRY_PLUGINS."


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
    """No recipe of that name among the installed recipes (the working directory is never searched)."""

    def __init__(self, name: str, known: Iterable[str], hint: str = "") -> None:
        self.name = name
        self.known = tuple(sorted(known))
        self.hint = hint
        super().__init__(name)

    def __str__(self) -> str:
        text = f"unknown recipe {self.name!r}; known recipes: {', '.join(self.known)}"
        return f"{text}. {self.hint}" if self.hint else text


class RecipeError(WorldFoundryError, ValueError):
    """A recipe file is malformed."""


class ClassNotAllowedError(RecipeError):
    """A recipe names a class outside the allowlist (nothing was imported or called).

    Recipes may name top-level diffusers models/schedulers, transformers models/configs/tokenizers/image
    processors, worldfoundry's own classes and classes registered through the ``worldfoundry.classes`` entry point
    group."""


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


class CommandLineError(WorldFoundryError, ValueError):
    """A command-line argument is wrong (a missing file, a file where a directory belongs, an unusable
    device); the message names the flag and what to pass instead."""

    def __init__(self, flag: str, message: str) -> None:
        self.flag = flag
        super().__init__(f"{flag}: {message}")
class ArtifactFormatError(ArtifactMismatchError):
    """An artifact file is malformed: ``.file`` and ``.field`` name where (e.g. ``linears['x'].tensors.qweight``)."""

    def __init__(self, file: str, field: str, message: str) -> None:
        self.file = file
        self.field = field
        super().__init__(f"{file}: {field}: {message}")


class InvalidRequestError(WorldFoundryError, ValueError):
    """A generation request has invalid fields (frame count, size, steps, ...)."""


class MissingDependencyError(WorldFoundryError, ImportError):
    """An optional capability needs a package that is not installed; the message names the package."""

    def __init__(self, feature: str, package: str, detail: str = "") -> None:
        self.feature = feature
        self.package = package
        extra = f" ({detail})" if detail else ""
        super().__init__(f"{feature} needs the package {package!r}{extra}: pip install {package}")


class CandidateSchemaError(WorldFoundryError, ValueError):
    """A benchmark candidate file does not match the documented schema. The message names the JSON path."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        super().__init__(f"{path}: {message}")


class BenchArgumentError(WorldFoundryError, ValueError):
    """Benchmark arguments contradict each other or are out of range (``--model`` with ``--recipe-file``, ...)."""


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


# --- untrusted files -----------------------------------------------------------------------------


class CheckpointKeysError(CheckpointError):
    """A checkpoint's tensor names differ from the model's: ``.missing`` and ``.unexpected`` list them all."""

    def __init__(self, where: str, missing: Sequence[str], unexpected: Sequence[str], hint: str = "") -> None:
        self.where = where
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing tensor(s): {', '.join(repr(k) for k in self.missing[:6])}"
                         + (" ..." if len(self.missing) > 6 else ""))
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected tensor(s): "
                         f"{', '.join(repr(k) for k in self.unexpected[:6])}" + (" ..." if len(self.unexpected) > 6 else ""))
        super().__init__(f"{where}: the checkpoint does not match the model: {'; '.join(parts)}. "
                         + (hint or "Use the checkpoint written for this model configuration."))


class NonFiniteWeightsError(CheckpointError):
    """A weight tensor holds NaN or Inf values; ``.key`` names it."""

    def __init__(self, where: str, key: str, count: int | None = None) -> None:
        self.where = where
        self.key = key
        what = f"{count} NaN/Inf value(s)" if count is not None else "NaN or Inf values"
        super().__init__(f"{where}: tensor {key!r} holds {what}; the file is corrupt or was saved from a diverged "
                         "model. Use an intact checkpoint")


class InputFileError(WorldFoundryError, ValueError):
    """A file given as input cannot be accepted before reading it (missing, a directory, a special file, too large).

    ``.file`` names it."""

    def __init__(self, file: str, message: str) -> None:
        self.file = file
        super().__init__(f"{file}: {message}")


class JsonInputError(WorldFoundryError, ValueError):
    """A JSON input is malformed (not UTF-8, invalid syntax, duplicate keys, too deep, a number out of range).

    ``.file`` and ``.path`` (``$.workload.frames``) name the file and the value."""

    def __init__(self, file: str, path: str, message: str) -> None:
        self.file = file
        self.path = path
        super().__init__(f"{file}: {path}: {message}")


class CalibrationArtifactError(ArtifactMismatchError):
    """A calibration artifact is malformed; ``.file`` and ``.key`` (``checkpoint.sha256``) name the bad field."""

    def __init__(self, file: str, key: str, message: str) -> None:
        self.file = file
        self.key = key
        super().__init__(f"{file}: {key}: {message}; write the artifact again with calibrate_plugins.py")


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


# --- attention providers -------------------------------------------------------------------------


class UnknownAttentionProviderError(WorldFoundryError, KeyError):
    """An attention provider name is not registered."""

    def __init__(self, name: str, known: Iterable[str]) -> None:
        self.name = name
        self.known = tuple(sorted(known))
        super().__init__(
            f"unknown attention provider {name!r}; registered providers: {list(self.known)}. Install the "
            "distribution that provides it (entry-point group 'worldfoundry.attention_providers') or register it "
            "with register_attention_provider(...)"
        )

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class DuplicateAttentionProviderError(WorldFoundryError, ValueError):
    """An attention provider name is registered twice without ``replace=True``."""


class AttentionProviderError(WorldFoundryError, RuntimeError):
    """An attention provider cannot run where it was asked to, or returned a result that breaks the contract."""

    def __init__(self, provider: str, reason: str) -> None:
        self.provider = provider
        self.reason = reason
        super().__init__(
            f"attention provider {provider!r}: {reason}. Choose another backend for this attention type, or set "
            "on_unavailable='fallback' to run PyTorch SDPA instead (visible in the receipts)."
        )
