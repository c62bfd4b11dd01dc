"""Shared fakes of the bench's timing tests: a settable clock, synthetic timed samples, a registry of one exact
test plugin."""

from __future__ import annotations

from worldfoundry.bench.timing import Timed


class Clock:
    """A clock that stands still until a test moves ``now``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed(seconds: float, seed: int = 7, steps: int = 3) -> Timed:
    """A generation of ``seconds`` split evenly over ``steps`` steps, its host busy a tenth of each."""
    return Timed(seconds, tuple([seconds / steps] * steps), seed, 1.0, tuple([0.1 * seconds / steps] * steps))


def exact_registry():  # noqa: ANN201 - an AccelerationRegistry
    """A registry holding only ``exact_test``, an exact plugin of the harness tests."""
    from tests.bench.test_harness import _scale_factory
    from worldfoundry.core.acceleration.registry import AccelerationRegistry

    reg = AccelerationRegistry(discover=False)
    reg.register("exact_test", _scale_factory("exact_test", exact=True))
    return reg


def tiny_candidates(folder, names=("a", "b")):  # noqa: ANN001, ANN201 - a Path in, a Path out
    """A candidate file for the tiny model (5 frames of 32 x 32, 2 steps, seed 1, 0.5 s of timing per candidate)
    with one ``exact_test`` row per name, written under ``folder``."""
    import json

    data = {"workload": {"prompt": "a red square", "frames": 5, "height": 32, "width": 32, "steps": 2,
                         "guidance": 5.0, "seeds": [1]}, "timing": {"time_budget_s": 0.5},
            "candidates": [{"name": n, "accelerations": {"exact_test": {}}} for n in names]}
    path = folder / "c.json"
    path.write_text(json.dumps(data))
    return path
