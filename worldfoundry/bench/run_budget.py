"""A wall-clock limit for a whole bench run, applied to the time the run may add.

A run's length has two parts. The mandatory part is the same on every host: loading, the control pairs, each
candidate's installation, quality generations and its rounds up to its time budget, the peers, the report. The
optional part depends on the host: rounds past a candidate's budget (an undecided CI, a dense arm in a slow phase,
a decided CI still wider than the target and paid by the width pool) and the host gate's waits for a fast phase.
On an H200 at W17 the optional part was 10 s in one run and 100 s in the next.

:class:`RunBudget` bounds the optional part so that the run ends near ``seconds`` after it began (the bench starts its
clock when ``run_bench`` is called, so validating the candidate file and discovering the plugins count). Before each
optional round or wait it asks :meth:`RunBudget.slack_s`: the seconds left before the deadline minus a reserve for
what is still mandatory (the items not yet started, plus :data:`TAIL_S` for the report). No slack: the round is not
added, the wait ends, and :attr:`cut` counts it. A round that only narrows a decided CI (the width pool's) is held to
the current item's fair share of the slack (:meth:`RunBudget.fair_room_s`: the share fixed when it started, less
the fair rounds it has run, and never more than its share of the slack now), so the first rows cannot spend what
the last rows and the peers need (at W17 on an H200 an early row ran ten rounds, five of them width rounds, 43 s
with its host waits, and a later row's verdict round was refused); a round that decides a verdict, and a host-gate
wait (a generation timed in a slow phase is lost to the step floor), may use all of it. The mandatory part is never
cut: a run whose mandatory part alone exceeds ``seconds`` overruns, and :meth:`to_json` says by how much.

Candidates and peers are priced apart, each at the **mean** mandatory cost of the finished items of its kind: the
reserve stands for the sum of the items left, and a median under-prices it whenever costs are skewed (at W17 on an
H200 rows cost 13-18 s and torch.compile's row 25 s; priced at their median, 14 s, the runs overran their budget by
38-58 s). Before any candidate has finished a candidate costs ``first_item_s`` (the bench sets it from the
generations a row needs and the measured cost of one in the control pairs, :meth:`RunBudget.reprice`); before any
peer has finished a peer costs :data:`PEER_PRICE_FACTOR` candidates (its compilation or cache warm-up comes on top
of a row).

Example::

    budget = RunBudget(280.0)
    budget.plan(items=13, first_item_s=12.0, peers=2)   # 13 candidates, about 12 s each before any has run; 2 peers
    budget.reprice(first_item_s=14.5)          # measured: 11 generations of a row at 1.32 s each
    budget.start_item(optional_s=0.0)          # the run's optional seconds so far (waits + width-pool rounds)
    ...                                        # run_rounds / HostGate consult budget.slack_s()
    budget.end_item(optional_s=4.2)            # the same total after the item: 4.2 s of it were not its price
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

#: Seconds kept for what follows the last item: the dense check generation and writing results, report and plots.
TAIL_S: Final = 15.0
#: A peer's price, in candidate items, until a peer has finished (W17 on an H200: a row's mandatory part 12 s,
#: torch.compile's 19 s with its warm-up, FirstBlockCache's 13 s).
PEER_PRICE_FACTOR: Final = 1.5
#: The kinds of item a run prices apart.
ITEM_KINDS: Final = ("candidate", "peer")


class RunBudget:
    """The run's deadline and the slack it leaves for optional time (see the module docstring).

    Args:
        seconds: the run's wall-clock limit, counted from ``started``.
        started: the run's start on ``clock`` (default: now).
        tail_s: seconds reserved after the last item.
        clock: ``time.perf_counter`` (tests pass a fake).

    Raises:
        ValueError: ``seconds`` not positive, or ``tail_s`` negative.
    """

    def __init__(self, seconds: float, *, started: float | None = None, tail_s: float = TAIL_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not seconds > 0:
            raise ValueError(f"run budget: seconds must be > 0, got {seconds}")
        if not tail_s >= 0:
            raise ValueError(f"run budget: tail_s must be >= 0, got {tail_s}")
        self.seconds, self.tail_s, self._clock = float(seconds), float(tail_s), clock
        self.started = clock() if started is None else float(started)
        self.items_left = 0
        self.peers_left = 0
        #: 1 while a settling pass may follow the items (:mod:`worldfoundry.bench.settle`): one candidate's price is
        #: kept for it in the reserve, and it counts as one item in the fair shares
        self.settle_shares = 0
        self.first_item_s = 0.0
        #: the mandatory cost of each finished candidate and peer
        self.costs: list[float] = []
        self.peer_costs: list[float] = []
        #: optional rounds not added and host waits ended because no slack was left
        self.cut = 0
        #: seconds of rounds past a candidate's budget that the width pool did not pay for (an undecided CI, a dense
        #: arm in a slow phase): optional time, left out of the items' prices
        self.extended_s = 0.0
        self._item_started: tuple[float, float, str] | None = None
        #: the current item's fair share, fixed when it started (``None``: no item started), and the seconds of
        #: fair rounds it has spent (:meth:`charge_fair`)
        self.item_share_s: float | None = None
        self.item_fair_s = 0.0

    def plan(self, items: int, first_item_s: float, *, peers: int = 0, settle: bool = False) -> None:
        """``items`` candidates still to run, priced at ``first_item_s`` each until one has finished, and ``peers``
        peers; ``settle``: a settling pass may follow them: the reserve keeps one candidate's price for it (host
        waits and optional rounds cannot spend it) and the fair shares count it as one more item, until
        :meth:`release_settle`."""
        if items < 0 or peers < 0 or not first_item_s >= 0:
            raise ValueError(f"run budget plan: expected items >= 0, peers >= 0 and first_item_s >= 0, got {items}, "
                             f"{peers}, {first_item_s}")
        self.items_left, self.peers_left, self.first_item_s = int(items), int(peers), float(first_item_s)
        self.settle_shares = int(bool(settle))

    def reprice(self, first_item_s: float) -> None:
        """A better price for a candidate before any has finished (e.g. measured on the control pairs)."""
        if not first_item_s >= 0:
            raise ValueError(f"run budget reprice: expected first_item_s >= 0, got {first_item_s}")
        self.first_item_s = float(first_item_s)

    @property
    def item_s(self) -> float:
        """The price of one candidate: the mean mandatory cost of those finished, else ``first_item_s``."""
        return statistics.fmean(self.costs) if self.costs else self.first_item_s

    @property
    def peer_s(self) -> float:
        """The price of one peer: the mean mandatory cost of the peers finished, else :data:`PEER_PRICE_FACTOR`
        candidates."""
        return statistics.fmean(self.peer_costs) if self.peer_costs else PEER_PRICE_FACTOR * self.item_s

    def reserve_s(self) -> float:
        """Seconds still mandatory after the current item: the items not started, the price kept for a settling
        pass and the tail."""
        return (self.items_left + self.settle_shares) * self.item_s + self.peers_left * self.peer_s + self.tail_s

    def release_settle(self) -> None:
        """The settling pass starts, or will not run (no verdict left unsettled): what was kept for it is slack."""
        self.settle_shares = 0

    def elapsed_s(self) -> float:
        return self._clock() - self.started

    def slack_s(self) -> float:
        """Seconds of optional time left (0 when the deadline minus the reserve has passed)."""
        return max(0.0, self.seconds - self.elapsed_s() - self.reserve_s())

    def share_s(self) -> float:
        """The current item's fair share of the slack now: the slack split evenly between it and the items not
        started (what an item leaves unused stays in the slack for the next ones)."""
        return self.slack_s() / self._shares()

    def _shares(self) -> int:
        """The current item and those still to come, the settling pass counted as one."""
        return 1 + self.items_left + self.peers_left + self.settle_shares

    def fair_room_s(self) -> float:
        """Seconds of fair rounds the current item may still add: its share now, and no more than what is left of
        the share it was given when it started (:attr:`item_share_s` minus :attr:`item_fair_s`), so one item
        cannot take round after round while the slack is large early in a run."""
        room = self.share_s()
        if self.item_share_s is not None:
            room = min(room, self.item_share_s - self.item_fair_s)
        return max(0.0, room)

    def charge_fair(self, seconds: float) -> None:
        """A fair round of the current item took ``seconds``."""
        self.item_fair_s += max(0.0, float(seconds))

    def allow(self, need_s: float = 0.0, *, fair: bool = False) -> bool:
        """Whether an optional round of about ``need_s`` seconds (the last round's) fits in the slack; a refusal is
        counted in :attr:`cut`.

        ``fair=True`` for a round that does not decide a verdict (it only narrows a decided CI): it must fit
        in :meth:`fair_room_s`, so the items still to come keep their share. Rounds that decide a verdict (an undecided
        or fragile CI, a dense arm in a slow phase) may use the whole slack."""
        slack = self.fair_room_s() if fair else self.slack_s()
        if slack > 0 and slack >= need_s:
            return True
        self.cut += 1
        return False

    def start_item(self, optional_s: float = 0.0, kind: str = "candidate") -> None:
        """An item of ``kind`` (``"candidate"`` or ``"peer"``) begins: it leaves the reserve. ``optional_s``: the
        run's optional seconds so far (host waits and width-pool rounds)."""
        if kind not in ITEM_KINDS:
            raise ValueError(f"run budget: kind must be one of {', '.join(ITEM_KINDS)}, got {kind!r}")
        if kind == "peer":
            self.peers_left = max(0, self.peers_left - 1)
        else:
            self.items_left = max(0, self.items_left - 1)
        self._item_started = (self._clock(), float(optional_s), kind)
        own = self.peer_s if kind == "peer" else self.item_s  # its own mandatory part is not slack it may spend
        self.item_share_s = max(0.0, self.slack_s() - own) / self._shares()
        self.item_fair_s = 0.0

    def end_item(self, optional_s: float = 0.0) -> None:
        """The item begun by :meth:`start_item` ended; ``optional_s``: the run's optional seconds now. The item's
        price is its wall time minus the optional seconds it added."""
        if self._item_started is None:
            raise RuntimeError("run budget: end_item without start_item")
        began, optional_before, kind = self._item_started
        added = max(0.0, float(optional_s) - optional_before)
        (self.peer_costs if kind == "peer" else self.costs).append(max(0.0, self._clock() - began - added))
        self._item_started = None
        self.item_share_s = None

    def to_json(self) -> dict[str, Any]:
        """The limit, the time used so far, the overrun it implies with the tail still to come, the prices of a
        candidate and a peer and the optional time refused."""
        elapsed = self.elapsed_s()
        return {"seconds": self.seconds, "elapsed_s": round(elapsed, 3),
                "over_s": round(max(0.0, elapsed + self.reserve_s() - self.seconds), 3),
                "item_s": round(self.item_s, 3), "peer_s": round(self.peer_s, 3),
                "first_item_s": round(self.first_item_s, 3),
                "items_priced": len(self.costs) + len(self.peer_costs), "tail_s": self.tail_s,
                "cut": self.cut, "extended_s": round(self.extended_s, 3)}


@contextlib.contextmanager
def budget_item(budget: RunBudget | None, optional_s: Callable[[], float], kind: str = "candidate") -> Iterator[None]:
    """One item of ``kind`` of the run under ``budget`` (nothing when ``None``); ``optional_s()`` reads the run's
    optional seconds so far, before and after the item."""
    if budget is None:
        yield
        return
    budget.start_item(optional_s(), kind)
    try:
        yield
    finally:
        budget.end_item(optional_s())


def describe(budget: dict[str, Any] | None) -> str:
    """One report line for :meth:`RunBudget.to_json`'s mapping."""
    if not budget:
        return "none (rounds past a candidate's budget and host waits bounded only by their own limits)"
    line = (f"{budget['seconds']:.0f} s; {budget['elapsed_s']:.0f} s used before the report; "
            f"{budget['cut']} optional rounds or waits refused for lack of time")
    if "peer_s" in budget:  # what the reserve assumed at the end: the mean mandatory cost of a row and of a peer
        line += f"; a candidate priced at {budget['item_s']:.1f} s, a peer at {budget['peer_s']:.1f} s"
    if budget["over_s"] > 0:
        line += f"; over by about {budget['over_s']:.0f} s: the mandatory work alone took longer"
    return line


__all__ = ["ITEM_KINDS", "PEER_PRICE_FACTOR", "TAIL_S", "RunBudget", "budget_item", "describe"]
