"""The caching allocator's verdict on a search (`replay_listing`, `replayed_max_seq`): the listed plans are replayed
(memory/reserved.py) as `estimate` replays them; a plan whose run dies in the replay is taken out of the listing and
the next plans that fit the vectorised bound are replayed in its place, so every plan listed is one `estimate` says
fits. `search --max-seq` answers the longest length at which a listed plan survives its replay. The count of plans
that fit stays the vectorised bound's (allocated peak + the margin + runtime within the budget): plans not listed are
not replayed, and the search says so. A plan whose run dies no longer fits the search: the listing is arranged and
folded again without it."""

from __future__ import annotations

from typing import Callable

from memplan.core.errors import MemplanError
from memplan.memory.reserved import Replay
from memplan.memory.term_bytes import PlanValues
from memplan.plan.arrange import arrange
from memplan.plan.estimate import device_bytes
from memplan.plan.limits import fits_below, settled
from memplan.plan.search import SEQ_STEP, SearchResult, mark_max_seq
from memplan.plan.stage_verdict import not_replayed

# How many more rows than asked for a listing may replay to replace the rows whose run dies (a bound on the work:
# each replay is a run of tens of thousands of allocator events).
EXTRA_REPLAYS = 20


def _verdict(result: SearchResult, plan: int, replay: Replay) -> tuple[int, str]:
    """What plan needs as `estimate` decides it and what the stream does not model ("" when the plan is replayed):
    where not streamed, the flat margin alone decides, which is the search's own bound."""
    config = result.config(plan)
    if why := not_replayed(config.training, PlanValues.from_config(config)):
        return int(result.numbers(plan)["device_bytes"]), why
    return device_bytes(config, result.impl, "cuda", result.gpu, result.margin, result.budget_bytes, replay), ""


def replay_listing(result: SearchResult, sort: str = "time", fold: bool = True, top: int = 10,
                   replay: Replay = Replay()) -> SearchResult:
    """Arrange the search's listing (`arrange`) and decide its plans as `estimate` does (`_verdict`). A plan whose run
    dies in the replay no longer fits the search either (its device memory is set to what it needs, so the listing is arranged and
    folded again without it), and the next rows are decided in its place (at most `EXTRA_REPLAYS` more decisions),
    so the listing keeps `top` rows where that many fit. The rows show what `estimate` says each needs (folded
    variants are counted on the bound, not replayed). Says what was decided."""
    verdicts: dict[int, tuple[int, str]] = {}
    while True:
        arrange(result, sort, fold, top)
        rows = result.listed()
        new = [row.plan for row in rows if row.plan not in verdicts]
        if not new:
            break
        over = []
        for plan in new[:max(top + EXTRA_REPLAYS - len(verdicts), 0)]:
            verdicts[plan] = _verdict(result, plan, replay)
            if verdicts[plan][0] > result.budget_bytes:
                over.append(plan)
        if not over:  # the listing stands: arranged again it would be the same rows, every one decided
            break
        _no_longer_fit(result, {plan: verdicts[plan][0] for plan in over})
    kept = [row for row in result.listed() if row.plan in verdicts and verdicts[row.plan][0] <= result.budget_bytes]
    result.listing, result.top = kept, [row.plan for row in kept]
    for row in kept:
        result.exact[row.plan]["device_bytes"] = verdicts[row.plan][0]
    if verdicts:
        result.notes.append(_note(verdicts, kept, replay, result.budget_bytes, fold))
    return result


def _no_longer_fit(result: SearchResult, needs: dict[int, int]) -> None:
    """Plans the verdict takes over the budget: their device memory is what they need, out of the search's fits."""
    device = result.evaluated.device_bytes
    for plan, need in needs.items():
        device[plan] = need
        if plan in result.exact:
            result.exact[plan]["device_bytes"] = need
    result.top = [plan for plan in result.top if plan not in needs]
    result.feasible -= len(needs)


def _plans(n: int) -> str:
    return f"{n} plan" + ("" if n == 1 else "s")


def _note(verdicts: dict[int, tuple[int, str]], kept: list, replay: Replay, budget: int, fold: bool) -> str:
    replayed = [need <= budget for need, why in verdicts.values() if not why]
    died = replayed.count(False)
    skipped = [verdicts[row.plan][1] for row in kept if verdicts[row.plan][1]]
    how = f"PyTorch's caching allocator ({replay.label}; derived, not measured)"
    why = f"the allocation stream does not model {', '.join(dict.fromkeys(skipped))} yet"
    if not replayed:
        return (f"no listed plan replayed through {how}: {why}; the count of plans that fit is the bound allocated peak + "
                "margin + runtime")
    what = f"{_plans(len(replayed))} replayed through {how}"
    what += (f": {died} of them died in the replay, left out, the next plans that fit taking their place" if died
             else ": each completes") + " (a listed row shows what estimate says it needs)"
    if skipped:
        what += f"; {_plans(len(skipped))} listed not replayed ({why})"
    return what + ("; the count of plans that fit is the bound allocated peak + margin + runtime"
                   + (f" less the {died} that died" if died else "")
                   + (", folded variants counted on that bound" if fold else ""))


def replayed_max_seq(result: SearchResult, search_at: Callable[[int], SearchResult],
                     step: int = SEQ_STEP) -> SearchResult:
    """`search --max-seq` under the replay: `result` is the replayed listing at the longest length the vectorised
    bound fits (`search_max_seq`, a multiple of `step`); when no listed plan survives its replay there, the lengths
    below it are searched (`fits_below`, on `search_at(s)`: a search at s, its listing replayed) for one with a
    survivor, one step longer having none. The replay needs at least the bound's memory: no longer length has one.
    The answer is then settled as estimate's `--max-seq` settles its own (limits.settled: a shorter length in the
    window below it at which no listed plan survives moves it below that length), so that search and estimate give
    one answer for a pinned plan."""
    longest = result.max_seq_len
    if longest is None:
        return result
    found: dict[int, SearchResult] = {}

    def survives(s: int) -> bool:
        probe = result if s == longest else search_at(s)
        if probe.top:
            found[s] = probe
        return bool(probe.top)

    first = longest if survives(longest) else fits_below(survives, longest, step)
    s = settled(survives, first, step)
    if s is None:
        raise MemplanError(f"no plan of {result.model.name} survives the caching allocator's replay in "
                           f"{result.budget_bytes:,} bytes per GPU even at s = {step}")
    if s == longest:
        return result
    best = mark_max_seq(found[s], s, step)
    if first == longest:
        best.notes.insert(0, f"a listed plan's run completes in the caching allocator's replay at s = {longest:,} "
                             f"tokens (the allocated-peak bound's longest), but every one dies at a shorter length "
                             f"(limits.settled's window); at s = {s:,} one completes, at {s + step:,} none does")
    else:
        best.notes.insert(0, f"the allocated-peak bound fits s = {longest:,} tokens, but every listed plan's run dies "
                             f"there in the caching allocator's replay; at s = {s:,} one completes, at "
                             f"{s + step:,} none does")
    return best
