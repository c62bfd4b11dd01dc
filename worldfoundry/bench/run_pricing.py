"""How a bench run prices its items for the run budget (:class:`~worldfoundry.bench.run_budget.RunBudget`): what a
candidate row and a peer cost before any has run, what a row costs once the control pairs have measured a
generation, and which of the run's seconds were optional (host waits, width-pool rounds, extensions).

Example::

    plan_items(budget, candidates=13, peers=["compile", "fbcache"], device=torch.device("cuda"), tpolicy=policy,
               gate=gate)
    mark = generation_mark(runner)                 # before the control pairs
    ...                                            # the control pairs run
    reprice_rows(budget, runner, mark, policy, n_seeds=1)   # a row = row_generations(1, 4) = 11 generations
"""

from __future__ import annotations

import time
from typing import Any

import torch

from worldfoundry.bench.host_gate import HostGate
from worldfoundry.bench.run_budget import RunBudget
from worldfoundry.bench.timing import SWITCH_BLOCK, TimingPolicy


def plan_items(budget: RunBudget, *, candidates: int, peers: list[str] | None, device: torch.device,
               tpolicy: TimingPolicy, gate: HostGate | None) -> None:
    """Price the run's items (``candidates`` rows at twice the time budget until the control pairs measure a
    generation, the ``peers`` that will run apart) and let the host gate wait only while the run budget leaves
    slack (all of it: held to an item's fair share, at W17 on an H200, 144 waits were cut short and 19 % of the timed
    generations ran in a slow phase, against 41 and 8 % in the run before)."""
    from worldfoundry.bench.peers import resolve_peers

    n_peers = len(resolve_peers(peers, device)[0]) if peers else 0
    budget.plan(candidates, 2 * tpolicy.budget_s, peers=n_peers, settle=True)
    if gate is not None:
        gate.limit = budget.slack_s


def row_generations(n_seeds: int, min_rounds: int) -> int:
    """Generations of a candidate's mandatory part: a pilot per seed, both arms of ``min_rounds`` rounds and one
    warm-up per block of :func:`~worldfoundry.bench.timing.switching_pairs` (the first block needs none)."""
    return n_seeds + 2 * min_rounds + -(-min_rounds // SWITCH_BLOCK)


def generation_mark(runner: Any) -> tuple[float, int, float]:
    """Where the run stands: now, the generations so far (``runner.counter``) and the host gate's waits so far."""
    gate = getattr(runner, "host_gate", None)
    return time.perf_counter(), runner.counter, gate.waited_s if gate is not None else 0.0


def reprice_rows(budget: RunBudget | None, runner: Any, since: tuple[float, int, float], tpolicy: TimingPolicy,
                 n_seeds: int) -> None:
    """Price a candidate from the generations run since ``since`` (a :func:`generation_mark`: the control pairs,
    not the dense pilots, whose first calls and decoding a row's generations do not repeat): their mean wall, host
    waits left out, times :func:`row_generations`."""
    now, count, waited = generation_mark(runner)
    if budget is None or count <= since[1]:
        return
    generation_s = max(0.0, now - since[0] - (waited - since[2])) / (count - since[1])
    budget.reprice(generation_s * row_generations(n_seeds, tpolicy.min_rounds))


def optional_seconds(gate: HostGate | None, tpolicy: TimingPolicy) -> float:
    """The run's optional seconds so far: the host gate's waits, the width pool's rounds and the other rounds past
    a candidate's budget."""
    extended = tpolicy.run_budget.extended_s if tpolicy.run_budget is not None else 0.0
    return ((gate.waited_s if gate is not None else 0.0) + (tpolicy.width_pool.spent if tpolicy.width_pool else 0.0)
            + extended)


__all__ = ["generation_mark", "optional_seconds", "plan_items", "reprice_rows", "row_generations"]
