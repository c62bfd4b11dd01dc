"""Peer reference rows: what a user would otherwise turn on, timed the same way as the candidates.

Peers are not plugins: each is applied to the dense model for its rows and removed after (each undo is named
below), then timed in interleaved pairs against dense with :func:`~worldfoundry.bench.timing.switching_pairs` (one
untimed generation after every apply or undo).

* ``eager``: diffusers eager (dense against dense: the control, shown as a row).
* ``compile``: ``ModelMixin.compile_repeated_blocks()`` (regional torch.compile); the warm-up (compile) time is
  reported. Undo: the compiled call of each block is dropped. Skipped on the CPU unless named explicitly.
* ``fbcache``: diffusers ``enable_cache(FirstBlockCacheConfig(threshold))`` with one ``cache_context`` per CFG
  branch. Undo: ``disable_cache()``.
* ``dbcache``: cache-dit DBCache, when ``cache_dit`` is installed, on each transformer (transformer-only use):
  its default thresholds (``residual_diff_threshold`` 0.08, ``Fn`` 8 / ``Bn`` 0 compute blocks) with
  ``Fn`` capped below the block count and ``max_warmup_steps`` a quarter of the workload's steps (cache-dit's 8
  would leave nothing to cache in a 10-step run); the context is refreshed with the step count before every
  generation. Undo: ``cache_dit.disable_cache``.
* ``float8``: torchao ``Float8DynamicActivationFloat8WeightConfig(set_inductor_config=False)``, when ``torchao`` is
  installed (CUDA only; torchao's default would switch float32 matmuls to TF32 process-wide). Undo: the original
  Linear weight parameters and ``extra_repr`` are put back, and the float32 matmul precision.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from worldfoundry.bench.metrics import relative_l2
from worldfoundry.bench.timing import Arm, Timed, TimingPolicy, switching_pairs, timed_generate

logger = logging.getLogger(__name__)

KNOWN_PEERS = ("eager", "compile", "fbcache", "dbcache", "float8")
DEFAULT_PEERS = ("eager", "compile", "fbcache", "dbcache", "float8")
FBCACHE_THRESHOLD = 0.05
DBCACHE_THRESHOLD = 0.08


def resolve_peers(names: list[str] | None, device: torch.device) -> tuple[list[str], list[dict[str, Any]]]:
    """The peers to run and the rows of those skipped (with why).

    Raises:
        ValueError: an unknown peer name.
    """
    explicit = bool(names) and names != ["all"]
    wanted = list(DEFAULT_PEERS) if not names or names == ["all"] else list(names)
    unknown = sorted(set(wanted) - set(KNOWN_PEERS))
    if unknown:
        raise ValueError(f"--peers: unknown peer(s) {unknown}; known: {', '.join(KNOWN_PEERS)}")
    run, skipped = [], []
    for name in wanted:
        reason = None
        if name == "compile" and device.type == "cpu" and not explicit:
            reason = "torch.compile is skipped on the CPU unless asked for (--peers compile)"
        elif name == "dbcache" and importlib.util.find_spec("cache_dit") is None:
            reason = "cache-dit is not installed"
        elif name == "float8" and importlib.util.find_spec("torchao") is None:
            reason = "torchao is not installed"
        elif name == "float8" and device.type != "cuda":
            reason = "torchao float8 needs CUDA"
        if reason:
            skipped.append({"name": f"peer:{name}", "peer": name, "verdict": "peer_skipped", "reason": reason})
        else:
            run.append(name)
    return run, skipped


def _with_branch_context(module: torch.nn.Module) -> Callable[[], None]:
    """Wrap ``module.forward`` in ``module.cache_context(branch)`` from the request context; returns the undo."""
    from worldfoundry.core.acceleration.context import current_request

    had = "forward" in vars(module)
    orig = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        ctx = current_request()
        with module.cache_context(ctx.branch if ctx is not None else "cond"):
            return orig(*args, **kwargs)

    module.forward = forward

    def undo() -> None:
        if had:
            module.forward = orig
        else:
            del module.forward

    return undo


def _apply(name: str, modules: list[torch.nn.Module],
           steps: int | None = None) -> tuple[Callable[[], None], dict[str, Any]]:
    """Apply one peer to every expert module (``steps``: the workload's); returns its undo and facts about it."""
    undos: list[Callable[[], None]] = []
    info: dict[str, Any] = {}
    if name == "eager":
        pass
    elif name == "compile":
        for m in modules:
            m.compile_repeated_blocks(fullgraph=True)
            compiled = [(b, b._compiled_call_impl) for b in m.modules()
                        if getattr(b, "_compiled_call_impl", None) is not None]

            def undo(compiled: list[Any] = compiled) -> None:
                for b, _ in compiled:
                    b._compiled_call_impl = None

            undos.append(undo)
            info.setdefault("_recompile", []).extend(compiled)
    elif name == "fbcache":
        from diffusers import FirstBlockCacheConfig

        for m in modules:
            m.enable_cache(FirstBlockCacheConfig(threshold=FBCACHE_THRESHOLD))
            undos.append(m.disable_cache)
            undos.append(_with_branch_context(m))
            undos.append(lambda m=m: m._reset_stateful_cache())
        info["threshold"] = FBCACHE_THRESHOLD
    elif name == "dbcache":
        _apply_dbcache(modules, steps, undos, info)
    elif name == "float8":
        _apply_float8(modules, undos)

    def undo_all() -> None:
        for fn in reversed(undos):
            fn()

    return undo_all, info


def _apply_dbcache(modules: list[torch.nn.Module], steps: int | None, undos: list[Callable[[], None]],
                   info: dict[str, Any]) -> None:
    """cache-dit DBCache on each module (see the module docstring for its settings)."""
    import cache_dit

    for m in modules:
        blocks = max((len(c) for c in m.children() if isinstance(c, torch.nn.ModuleList)), default=2)
        config = cache_dit.DBCacheConfig(
            Fn_compute_blocks=min(8, blocks - 1), Bn_compute_blocks=0, residual_diff_threshold=DBCACHE_THRESHOLD,
            max_warmup_steps=max(1, min(8, (steps or 8) // 4)), num_inference_steps=steps)
        cache_dit.enable_cache(m, cache_config=config)
        undos.append(lambda m=m: cache_dit.disable_cache(m))
        info.update(threshold=DBCACHE_THRESHOLD, Fn_compute_blocks=config.Fn_compute_blocks,
                    max_warmup_steps=config.max_warmup_steps)


def _apply_float8(modules: list[torch.nn.Module], undos: list[Callable[[], None]]) -> None:
    """torchao float8 dynamic-activation / float8-weight on every Linear, undone without global side effects."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, quantize_

    # set_inductor_config=False: by default torchao also calls torch.set_float32_matmul_precision("high"),
    # a process-wide switch to TF32 that changed the dense model's float32 matmuls after the peer was undone
    precision = torch.get_float32_matmul_precision()
    for m in modules:
        saved = [(lin, lin.weight, lin.__dict__.get("extra_repr")) for lin in m.modules()
                 if isinstance(lin, torch.nn.Linear)]
        quantize_(m, Float8DynamicActivationFloat8WeightConfig(set_inductor_config=False))

        def undo(saved: list[Any] = saved) -> None:
            for lin, weight, extra_repr in saved:
                lin.weight = weight
                if extra_repr is None:
                    lin.__dict__.pop("extra_repr", None)  # torchao's bound extra_repr
                else:
                    lin.extra_repr = extra_repr

        undos.append(undo)
    undos.append(lambda: torch.set_float32_matmul_precision(precision))


def _reset_caches(modules: list[torch.nn.Module], steps: int | None = None, cache_dit_active: bool = False) -> None:
    """Fresh per-generation cache state: diffusers' hooks reset, cache-dit's context refreshed."""
    for m in modules:
        if getattr(m, "is_cache_enabled", False):
            m._reset_stateful_cache()
    if cache_dit_active and steps:
        import cache_dit

        for m in modules:
            cache_dit.refresh_context(m, num_inference_steps=int(steps))


class _PeerState:
    """A peer applied to the dense model, switched off and on between the arms of its pairs."""

    def __init__(self, name: str, modules: list[torch.nn.Module], steps: int | None) -> None:
        self.name, self.modules, self.steps = name, modules, steps
        self.undo: Callable[[], None] | None = None
        self.undo, info = _apply(name, modules, steps)
        self.compiled = info.pop("_recompile", None)
        self.info = info
        self.active = True

    def reset(self) -> None:
        _reset_caches(self.modules, self.steps, self.name == "dbcache")

    def to_dense(self) -> bool:
        if not self.active:
            return False
        if self.undo is None:  # an active peer always holds its undo: a broken invariant, not bad input
            raise RuntimeError(f"peer {self.name!r} is active but holds no undo")
        self.undo()
        self.active = False
        return True

    def to_peer(self) -> bool:
        if self.active:
            return False
        if self.compiled:  # the compiled blocks are put back, not compiled again (no recompilation per round)
            for block, impl in self.compiled:
                block._compiled_call_impl = impl
        else:
            self.undo, _ = _apply(self.name, self.modules, self.steps)
        self.active = True
        return True

    def arms(self, runner: Any) -> tuple[Arm, Arm]:
        name = self.name

        def timed(seed: int, tag: str) -> Timed:
            _, seconds, phases = timed_generate(runner, seed, tag)
            return Timed.of(seconds, phases, seed)

        def peer_call(seed: int, is_timed: bool) -> Any:
            self.reset()
            if is_timed:
                return timed(seed, f"peer-{name}-timed")
            return runner.generate(seed, f"peer-{name}-warm")

        dense = Arm(self.to_dense, lambda r, seed: timed(seed, f"peer-{name}-dense"),
                    lambda seed: runner.generate(seed, f"peer-{name}-dense-warm"))
        peer = Arm(self.to_peer, lambda r, seed: peer_call(seed, True), lambda seed: peer_call(seed, False))
        return dense, peer


def run_peer(name: str, runner: Any, dense: dict[int, Any], seeds: list[int], policy: TimingPolicy) -> dict[str, Any]:
    """Apply, warm up (timed), check quality against the dense pilot, time in pairs, undo. Never raises."""
    den = runner.pipe.components.denoiser
    row: dict[str, Any] = {"name": f"peer:{name}", "peer": name}
    state: _PeerState | None = None
    try:
        state = _PeerState(name, list(den.experts.values()), runner.workload.get("steps"))
        row.update(state.info)
        t0 = time.perf_counter()
        state.reset()
        pilot = runner.generate(seeds[0], f"peer-{name}-warmup")
        row["warmup_s"] = time.perf_counter() - t0
        row["latent_rel_l2"] = max(relative_l2(pilot.latents, dense[seeds[0]].latents), 0.0)
        row["speed"] = switching_pairs(*state.arms(runner), seeds, policy,  # applied and warm: the peer goes first
                                       clock=getattr(runner, "clock", time.perf_counter), first="candidate")
        row["verdict"] = "peer_reference"
    except Exception as exc:  # a peer that fails is a row, not a crash
        logger.warning("peer %s failed: %s", name, exc)
        row.update(verdict="peer_failed", error=f"{type(exc).__name__}: {exc}")
    finally:
        _undo_into(row, state.undo if state is not None and state.active else None)
    return row


def _undo_into(row: dict[str, Any], undo: Callable[[], None] | None) -> None:
    """Run a peer's pending undo; an undo that raises is recorded in its row (never raised)."""
    if undo is None:
        return
    try:
        undo()
    except Exception as exc:
        row["undo_error"] = f"{type(exc).__name__}: {exc}"


def run_peers(names: list[str], runner: Any, dense: dict[int, Any], seeds: list[int], policy: TimingPolicy, *,
              item: Callable[[str], contextlib.AbstractContextManager[None]] | None = None) -> list[dict[str, Any]]:
    """Rows for the requested peers (skipped ones say why); ``item(name)``, when given, is entered around each
    peer's run (the run budget prices it)."""
    to_run, rows = resolve_peers(names, runner.pipe.policy.device)
    reference = dense[seeds[0]].latents  # what dense computes now: a peer that changes it is named once
    for name in to_run:
        with item(name) if item is not None else contextlib.nullcontext():
            row = run_peer(name, runner, dense, seeds, policy)
        rows.append(row)
        after = runner.generate(seeds[0], f"dense-after-peer-{name}").latents
        row["restored"] = bool(torch.equal(after, reference))
        if not row["restored"]:
            logger.error("the dense output changed after peer %s: its undo did not restore the model", name)
            row["restore_error"] = f"the dense output changed after {name} was undone"
            reference = after
    return rows
