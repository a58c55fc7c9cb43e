"""Pipeline schedules as data: a ``PipelinePlan`` holds, for each pipeline rank, its actions in order.

``build_plan(schedule, pp, microbatches, chunks)`` writes the compute actions (F, B, I, W)
of one training step; ``lower(plan)`` (lowering.py) adds the sends and receives;
``check(plan)`` (check.py) validates it in one process; ``simulate(plan)`` (simulate.py)
draws its timeline. Stage ``s`` runs on pipeline rank ``plan.rank_of(s)``.

What each rank sees for 1F1B with pp=4, microbatches=8 (``print(build_plan("1f1b", 4, 8))``):
rank r first runs ``pp-1-r`` warm-up forwards, then alternates one forward and one
backward, then drains the backwards it still owes::

    rank 0: 0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7
    rank 1: 1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7
    rank 2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7
    rank 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7

ZB-H1 (Qi et al. 2023) splits each backward into I (gradient of the stage input, which the
previous stage waits for) and W (gradient of the weights, which nobody waits for). Rank r
keeps the 1F1B order of F and I but holds back r of its W passes, so they fill the idle
slots near the end of the step instead of delaying the I chain
(``print(build_plan("zb-h1", 4, 8))``)::

    rank 0: 0F0 0F1 0F2 0F3 0I0 0W0 0F4 0I1 0W1 0F5 0I2 0W2 0F6 0I3 0W3 0F7 0I4 0W4 0I5 0W5 0I6 0W6 0I7 0W7
    rank 1: 1F0 1F1 1F2 1I0 1F3 1I1 1W0 1F4 1I2 1W1 1F5 1I3 1W2 1F6 1I4 1W3 1F7 1I5 1W4 1I6 1W5 1I7 1W6 1W7
    rank 2: 2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2F4 2I3 2W1 2F5 2I4 2W2 2F6 2I5 2W3 2F7 2I6 2W4 2I7 2W5 2W6 2W7
    rank 3: 3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3F4 3I4 3W1 3F5 3I5 3W2 3F6 3I6 3W3 3F7 3I7 3W4 3W5 3W6 3W7

With unit costs (F = I = W = 1) the step takes 3m + p - 1 time units instead of 1F1B's
3(m + p - 1), and no rank holds more microbatches between F and I than under 1F1B.

ZB-V (the same paper; ``build_plan("zb-v", pp, m, chunks=2)``) cuts the model into
2p stages placed in a V: stages 0..p-1 go down ranks 0..p-1 and stages p..2p-1 come back up
from rank p-1 to rank 0 (``PipelinePlan.rank_of``, placement 'v'). Rank 0 holds the embeddings and the
head, and the hop from stage p-1 to stage p stays in rank p-1's memory. The order comes from a
greedy list scheduler (``_zb_v``: ready I first, then a forward while the rank holds fewer than
2p chunk-microbatches, then the oldest W). ``print(build_plan("zb-v", 4, 8, 2))``, each rank's
line wrapped after 24 actions::

    rank 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 0I0 7W2 7F3 7I3 0I1 0W0 0I2 0F7 7W3
            7F4 0I3 7I4 0W1 0W2 0W3 7F5 7I5 7W4 0I4 7W5 7F6 7I6 0W4 7W6 0I5 0W5 7F7 7I7 0I6 7W7 0W6 0I7 0W7
    rank 1: 1F0 1F1 1F2 1F3 1F4 6F0 1F5 6F1 6I0 6W0 6F2 6I1 6W1 1I0 6I2 6F3 1W0 1I1 6I3 1I2 1F6 6W2 6F4 1I3
            1W1 1F7 6I4 6W3 6F5 1W2 1W3 1I4 6I5 6F6 6W4 1W4 6I6 1I5 6W5 6F7 6W6 1I6 6I7 1W5 1W6 6W7 1I7 1W7
    rank 2: 2F0 2F1 2F2 5F0 2F3 5F1 2F4 5F2 5I0 5W0 5F3 2I0 5I1 2W0 5I2 2I1 2F5 2I2 5I3 5W1 5F4 2I3 5W2 2F6
            2W1 5F5 5I4 2W2 2F7 2I4 5W3 5F6 5I5 2W3 5W4 2I5 5I6 5F7 2W4 2I6 5W5 2W5 5I7 5W6 2W6 2I7 5W7 2W7
    rank 3: 3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 3I0 4W0 3F4 4I1 3I1 4I2 3I2 3W0 4F4 4I3 3I3 4W1 3F5 3W1 4F5
            4W2 3F6 4I4 3I4 3W2 4F6 4W3 3F7 4I5 3I5 3W3 4F7 4I6 3I6 4W4 3W4 4W5 3W5 4I7 3I7 4W6 3W6 4W7 3W7

Those unit steps are an assumption: ``build_plan("zb-v", pp, m, 2, costs={(stage, kind): t})``
schedules the V on each stage's own F, I and W durations (``costs.py``; equal costs give this
very plan); an engine's first plan uses the stages' FLOPs (``build_plan_for(config, model_cfg)``),
and ``engine.pipeline.replan()`` measures them on the ranks.

Rank 0 runs 2p-1 = 7 chunk-0 forwards while microbatch 0 goes round the V to stage 7.
Each action is one chunk, half a rank's layers: with F = I = W = 1 per chunk (``simulate``)
every rank is busy 6m = 48 units and the step takes 6m + p - 1 = 51, the least possible (rank 3
cannot start before p - 1 chunk forwards reach it). Bubble 3/51 = 5.9%, against ZB-H1's 11.1%
(27 units of whole-rank passes) and 1F1B's 27.3% (33 units); in whole-rank units ZB-V takes
25.5 = 3m + (p-1)/2, half of ZB-H1's tail. Every rank holds at most 2p = 8 chunk-microbatches
between F and W, the 4 whole microbatches 1F1B's first rank holds, the same on every rank.
"""
from __future__ import annotations

from collections import deque

from .actions import Action
from .plan import SCHEDULE_PLACEMENT, PipelinePlan
from ..config import ParallelConfig
from .costs import flop_costs, zb_v_plan

__all__ = ["build_plan", "build_plan_for"]

# ------------------------------------------------------------------------ generators
def _gpipe(pp: int, m: int) -> list[list[Action]]:
    """All forwards, then all backwards (Huang et al. 2019)."""
    return [[Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)] for r in range(pp)]


def _one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    """PipeDream-flush / 1F1B: pp-1-r warm-up forwards, then one forward one backward, then drain."""
    plan = []
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        acts = [Action(r, "F", i) for i in range(warm)]
        for i in range(m - warm):
            acts += [Action(r, "F", warm + i), Action(r, "B", i)]
        acts += [Action(r, "B", i) for i in range(m - warm, m)]
        plan.append(acts)
    return plan


def _zb_h1(pp: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, arXiv 2401.10241): 1F1B with B split into I and W, rank r defers r W passes.

    The F/I order is exactly 1F1B's, so activations (held from F until I) peak as in
    1F1B. Each I is followed by the oldest pending W once more than r are pending;
    whatever is still pending runs at the end, where rank r would otherwise wait
    for the last input gradients to come back up the pipeline.
    """
    return [_zb_h1_rank(r, pp, m) for r in range(pp)]


def _zb_h1_rank(r: int, pp: int, m: int) -> list[Action]:
    """Rank ``r``'s actions in ZB-H1."""
    warm = min(pp - 1 - r, m)
    acts = [Action(r, "F", i) for i in range(warm)]
    pending: deque[int] = deque()

    def backward(i: int) -> None:
        acts.append(Action(r, "I", i))
        pending.append(i)
        if len(pending) > r:
            acts.append(Action(r, "W", pending.popleft()))

    for i in range(m - warm):
        acts.append(Action(r, "F", warm + i))
        backward(i)
    for i in range(m - warm, m):
        backward(i)
    return acts + [Action(r, "W", i) for i in pending]


def _interleaved(pp: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): v chunks per rank, stage c*pp + r.

    Rank r walks m*v "virtual microbatches" k. Forward k is microbatch
    ``(k // (pp*v)) * pp + k % pp`` of chunk ``(k % (pp*v)) // pp``; backward k is the same
    microbatch of chunk ``v - 1 - that``. Groups of pp microbatches go through chunk 0,
    then chunk 1, ... Warm-up is ``2*(pp-1-r) + (v-1)*pp`` forwards (all of them when
    m == pp), then one forward one backward, then the remaining backwards.
    """
    total = m * v

    def act(r: int, k: int, kind: str) -> Action:
        chunk = (k % (pp * v)) // pp
        if kind == "B":
            chunk = v - 1 - chunk
        return Action(chunk * pp + r, kind, (k // (pp * v)) * pp + k % pp)

    plan = []
    for r in range(pp):
        warm = total if m == pp else min(2 * (pp - 1 - r) + (v - 1) * pp, total)
        acts = [act(r, k, "F") for k in range(warm)]
        for k in range(total - warm):
            acts += [act(r, warm + k, "F"), act(r, k, "B")]
        acts += [act(r, k, "B") for k in range(total - warm, total)]
        plan.append(acts)
    return plan


def _zb_v(pp: int, m: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2023): two chunks per rank on the V placement, by greedy list scheduling.

    The clock ticks in unit steps (F = I = W = 1, a hand-off between ranks free, as in
    ``simulate``). At each step every rank runs one action whose inputs ended at an
    earlier step, trying in this order: the I of its oldest microbatch whose output
    gradient is there; else a forward, chunk 1 before chunk 0, if fewer than 2*pp
    (stage, microbatch) pairs are held between F and W on the rank (the 1F1B peak: a
    chunk is half a rank's layers); else the oldest W it owes. Microbatches pass each
    stage in order.
    """
    n, limit = 2 * pp, 2 * pp
    mine = [PipelinePlan(pp, m, 2, "zb-v", placement="v").stages_of(r) for r in range(pp)]  # [r, 2pp-1-r]
    ended: dict[tuple[str, int, int], int] = {}  # (kind, stage, microbatch) -> step it ran in
    next_f, next_i = [0] * n, [0] * n
    held = [0] * pp  # F done, W not yet
    owed: list[deque] = [deque() for _ in range(pp)]  # I done, W not yet
    plan: list[list[Action]] = [[] for _ in range(pp)]
    t, left = 0, 3 * n * m
    get = ended.get

    def pick(r: int) -> tuple | None:  # (kind, stage, microbatch); "ran at an earlier step": ended before t
        bwd = [(i, -s) for s in mine[r] if (i := next_i[s]) < m and get(("F", s, i), t) < t
               and (s == n - 1 or get(("I", s + 1, i), t) < t)]
        if bwd:
            i, s = min(bwd)
            return "I", -s, i
        if held[r] < limit:
            fwd = [(-s, i) for s in mine[r] if (i := next_f[s]) < m and (s == 0 or get(("F", s - 1, i), t) < t)]
            if fwd:
                s, i = min(fwd)
                return "F", -s, i
        return ("W", *owed[r][0]) if owed[r] else None

    while left:
        ran = [(r, a) for r in range(pp) if (a := pick(r)) is not None]
        if not ran:
            raise RuntimeError(f"zb-v list scheduler stuck at step {t} (pp={pp}, microbatches={m})")
        for r, (kind, s, i) in ran:
            ended[kind, s, i] = t
            plan[r].append(Action(s, kind, i))
            if kind == "F":
                next_f[s] += 1
                held[r] += 1
            elif kind == "I":
                next_i[s] += 1
                owed[r].append((s, i))
            else:
                owed[r].popleft()
                held[r] -= 1
        left -= len(ran)
        t += 1
    return plan


def build_plan(schedule: str, pp: int, microbatches: int, chunks: int = 1, costs: dict | None = None) -> PipelinePlan:
    """The compute actions of one step of ``schedule`` on ``pp`` ranks (see the module docstring).

    ``costs`` (zb-v only): ``{(stage, kind): time}`` for F, I and W, or kind defaults; the V is
    then list-scheduled on those durations instead of unit steps (``costs.zb_v_plan``), as the
    paper's automatic schedules use profiled times (``engine.pipeline.replan()`` measures them).

    Shapes a schedule cannot take raise ``ConfigError`` with the rule and a valid choice,
    the same rules ``ParallelConfig`` enforces::

        >>> build_plan("interleaved", pp=2, microbatches=3, chunks=2)  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        ...
        colab_kit.config.ConfigError: schedule='interleaved' needs microbatches divisible by pp=2
            (got microbatches=3): try microbatches=2 or 4
    """
    ParallelConfig(pp=pp, microbatches=microbatches, schedule=schedule, chunks=chunks)
    if costs is not None and schedule != "zb-v":
        raise ValueError(f"costs shape only the zb-v schedule (its list scheduler), not {schedule!r}: "
                         "leave costs=None, or use schedule='zb-v' with chunks=2")
    if costs is not None:
        actions = zb_v_plan(pp, microbatches, costs, _zb_v(pp, microbatches))
    elif schedule == "gpipe":
        actions = _gpipe(pp, microbatches)
    elif schedule == "1f1b":
        actions = _one_f_one_b(pp, microbatches)
    elif schedule == "zb-h1":
        actions = _zb_h1(pp, microbatches)
    elif schedule == "zb-v":
        actions = _zb_v(pp, microbatches)
    else:
        actions = _interleaved(pp, microbatches, chunks)
    return PipelinePlan(pp, microbatches, chunks, schedule, actions, placement=SCHEDULE_PLACEMENT[schedule])


def build_plan_for(config, model_cfg=None) -> PipelinePlan:
    """``build_plan`` with the pipeline fields of a ``ParallelConfig``: the plan the engine runs.

    For zb-v with the model's config (a ``GPTConfig``: what ``boost`` knows) the V is
    list-scheduled on each stage's FLOPs instead of unit steps (``costs.flop_costs``: the first
    stage's whole backward in W, the head's matmul on the last stage), before any step has run;
    ``engine.pipeline.replan()`` can refine it from measured costs later. Other schedules, or no
    model config, give ``build_plan``'s plan. A config without a vocabulary (ViT's) has no FLOP
    model here yet: unit steps.
    """
    if config.schedule == "zb-v" and all(hasattr(model_cfg, a) for a in ("vocab_size", "d_ff", "n_layers")):
        return build_plan("zb-v", config.pp, config.microbatches, config.chunks,
                          costs=flop_costs(model_cfg, config.pp * config.chunks))
    return build_plan(config.schedule, config.pp, config.microbatches, config.chunks)
