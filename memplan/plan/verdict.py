"""The caching allocator's verdict on a search (`replay_listing`, `replayed_max_seq`): the listed plans are replayed
(memory/reserved.py) as `estimate` replays them; a plan whose run dies in the replay is taken out of the listing and
the next plans that fit the vectorised bound are replayed in its place, so every plan listed is one `estimate` says
fits. `search --max-seq` answers the longest length at which a listed plan survives its replay. The count of plans
that fit stays the vectorised bound's (allocated peak + the margin + runtime within the budget): plans not listed are
not replayed, and the search says so."""

from __future__ import annotations

from typing import Callable, Union

from memplan.core.errors import MemplanError
from memplan.memory.reserved import Replay
from memplan.memory.stream import not_streamed
from memplan.memory.term_bytes import PlanValues
from memplan.plan.arrange import arrange
from memplan.plan.estimate import device_bytes
from memplan.plan.limits import fits_below
from memplan.plan.search import SEQ_STEP, SearchResult, mark_max_seq

# How many more rows than asked for a listing may replay to replace the rows whose run dies (a bound on the work:
# each replay is a run of tens of thousands of allocator events).
EXTRA_REPLAYS = 20


def _survives(result: SearchResult, plan: int, replay: Replay) -> Union[bool, str]:
    """Whether plan's run completes in the replay; what the stream does not model when the plan is not replayed."""
    config = result.config(plan)
    if why := not_streamed(config.training, PlanValues.from_config(config)):
        return why
    return device_bytes(config, result.impl, "cuda", result.gpu, result.margin, result.budget_bytes,
                        replay) <= result.budget_bytes


def replay_listing(result: SearchResult, sort: str = "time", fold: bool = True, top: int = 10,
                   replay: Replay = Replay()) -> SearchResult:
    """Arrange the search's listing (`arrange`) and replay its plans; a plan whose run dies is left out and the next
    rows of the listing's order are replayed in its place (at most `EXTRA_REPLAYS` more), so the listing keeps `top`
    rows where that many survive. Says what was replayed."""
    verdicts: dict[int, Union[bool, str]] = {}
    want = top
    while True:
        arrange(result, sort, fold, want)
        rows = result.listed()
        for row in rows:
            if row.plan not in verdicts:
                verdicts[row.plan] = _survives(result, row.plan, replay)
        kept = [row for row in rows if verdicts[row.plan] is not False]
        if len(kept) >= top or len(rows) < want or want >= top + EXTRA_REPLAYS:
            break
        want = min(top + EXTRA_REPLAYS, want + top - len(kept))
    kept = kept[:max(top, 0)]
    result.listing, result.top = kept, [row.plan for row in kept]
    if verdicts:
        result.notes.append(_note(verdicts, kept, replay))
    return result


def _plans(n: int) -> str:
    return f"{n} plan" + ("" if n == 1 else "s")


def _note(verdicts: dict[int, Union[bool, str]], kept: list, replay: Replay) -> str:
    replayed = [v for v in verdicts.values() if isinstance(v, bool)]
    died = replayed.count(False)
    skipped = [verdicts[row.plan] for row in kept if isinstance(verdicts[row.plan], str)]
    unreplayed = len(skipped)
    how = f"PyTorch's caching allocator ({replay.label}; derived, not measured)"
    why = f"the allocation stream does not model {', '.join(dict.fromkeys(skipped))} yet"
    if not replayed:
        what = f"no listed plan replayed through {how}: {why}"
    else:
        what = f"{_plans(len(replayed))} replayed through {how}"
        what += (f": {died} died in the replay and are left out, the next plans that fit taking their place" if died
                 else ": each completes")
        if unreplayed:
            what += f"; {_plans(unreplayed)} listed not replayed ({why})"
    return what + "; the count of plans that fit is the bound allocated peak + margin + runtime, not replayed"


def replayed_max_seq(result: SearchResult, search_at: Callable[[int], SearchResult],
                     step: int = SEQ_STEP) -> SearchResult:
    """`search --max-seq` under the replay: `result` is the replayed listing at the longest length the vectorised
    bound fits (`search_max_seq`, a multiple of `step`); when no listed plan survives its replay there, the lengths
    below it are searched (`fits_below`, on `search_at(s)`: a search at s, its listing replayed) for one with a
    survivor, one step longer having none. The replay needs at least the bound's memory: no longer length has one."""
    longest = result.max_seq_len
    if result.top or longest is None:
        return result
    found: dict[int, SearchResult] = {}

    def survives(s: int) -> bool:
        probe = search_at(s)
        if probe.top:
            found[s] = probe
        return bool(probe.top)

    s = fits_below(survives, longest, step)
    if s is None:
        raise MemplanError(f"no plan of {result.model.name} survives the caching allocator's replay in "
                           f"{result.budget_bytes:,} bytes per GPU even at s = {step}")
    best = mark_max_seq(found[s], s, step)
    best.notes.insert(0, f"the allocated-peak bound fits s = {longest:,} tokens, but every listed plan's run dies "
                         f"there in the caching allocator's replay; at s = {s:,} one completes, at "
                         f"{s + step:,} none does")
    return best
