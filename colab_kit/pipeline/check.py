r"""Validate a plan in one process, then step it: every rank runs its next action when it can.

``check(plan)`` raises ``PlanError`` (a ``ValueError``) naming the rank, the position in
that rank's list and the rule broken. The rules:

* count: every (stage, microbatch) has exactly one F, and one B or else one I and one W;
  each action sits on rank ``plan.rank_of(stage)``.
* forward: stage s's forward runs before stage s+1's forward of the same microbatch.
* backward: the backward (B or I) of stage s runs after that of stage s+1.
* own forward: a backward runs after its own stage's forward; W runs after its I.
* lowered plans: each compute whose input comes from another rank has its receive
  before it; each send follows the compute that produced it; every send has its
  matching receive on the peer rank and the other way round; between two ranks, messages
  are received in the order they were sent (so an executor may match them by order, as
  NCCL does, or by ``message_tag``).

Then the plan is stepped in lockstep: at each timestep every rank runs its next action
if everything it depends on ran at an earlier timestep (in a lowered plan a receive
depends on its matching send, not on the remote compute). If the ranks get stuck, the
error shows the last timesteps as a timestep x rank grid and what each rank waits for.
Rank 1 below starts with microbatch 1 while rank 0 wants microbatch 0 back first::

    >>> from colab_kit.pipeline import PipelinePlan, check
    >>> plan = PipelinePlan.parse("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1B1 1F0 1B0")
    >>> check(plan)  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    colab_kit.pipeline.check.PlanError: rank 0 position 1: plan deadlocks at timestep 1: no rank can run its next
        action (rule: ...)
    step | rank 0    | rank 1
       0 | 0F0       | .
       1 | waits 0B0 | waits 1F1
    rank 0 position 1: 0B0 waits for 1B0 (backward (B/I) of stage s after backward of stage s+1),
        at rank 1 position 3 behind 1F1
    rank 1 position 0: 1F1 waits for 0F1 (stage s's forward before stage s+1's forward of the same microbatch),
        at rank 0 position 2 behind 0B0
"""
from __future__ import annotations

from .actions import Action
from .lowering import inputs_of, match, outputs_of

__all__ = ["PlanError", "check", "steps", "format_grid", "RULES", "positions", "dependencies"]

RULES = {
    "count": "every (stage, microbatch) has exactly one F and one B (or one I and one W)",
    "placement": "stage s runs on pipeline rank plan.rank_of(s)",
    "forward": "stage s's forward before stage s+1's forward of the same microbatch",
    "backward": "backward (B/I) of stage s after backward of stage s+1",
    "own": "backward after its own forward",
    "w": "W after its I",
    "recv": "a compute whose input is on another rank has its receive before it",
    "send": "a send follows the compute that produced it and has its matching receive on the peer rank",
    "match": "a receive runs once its matching send has run",
    "fifo": "messages from one rank to another are received in the order they are sent",
    "deadlock": "every rank can always run its next action eventually",
}


class PlanError(ValueError):
    """A plan breaks a rule; ``rank``, ``position`` and ``rule`` say where and which."""

    def __init__(self, message: str, rank: int | None = None, position: int | None = None,
                 rule: str | None = None, detail: str = ""):
        where = f"rank {rank} position {position}: " if position is not None else (
            f"rank {rank}: " if rank is not None else "")
        rule_text = f" (rule: {RULES[rule]})" if rule else ""
        super().__init__(where + message + rule_text + (f"\n{detail}" if detail else ""))
        self.rank, self.position, self.rule = rank, position, rule


def positions(plan) -> dict[Action, tuple[int, int]]:
    """Where each action sits; also the count and placement rules."""
    where: dict[Action, tuple[int, int]] = {}
    n, m = plan.n_stages, plan.microbatches
    if len(plan.actions) != plan.pp:
        raise PlanError(f"plan has {len(plan.actions)} rank lists for pp={plan.pp}")
    for r, row in enumerate(plan.actions):
        for i, a in enumerate(row):
            if not (0 <= a.stage < n and 0 <= a.microbatch < m):
                raise PlanError(f"{a} is outside stages 0..{n - 1} / microbatches 0..{m - 1}", r, i, "count")
            if plan.rank_of(a.stage) != r:
                raise PlanError(f"{a} belongs on rank {plan.rank_of(a.stage)} ({plan.placement!r} placement)",
                                r, i, "placement")
            if a.is_comm and not plan.lowered:
                raise PlanError(f"{a} is a communication action in a plan with lowered=False", r, i, "send")
            if a.is_comm and not 0 <= match(a).stage < n:
                raise PlanError(f"{a} has no peer: stage {match(a).stage} does not exist", r, i, "send")
            if a.is_comm and plan.rank_of(match(a).stage) == r:
                raise PlanError(f"{a} talks to its own rank: stages on one rank hand tensors over locally, "
                                f"without communication", r, i, "send")
            if a in where:
                raise PlanError(f"{a} appears twice (first at position {where[a][1]})", r, i, "count")
            where[a] = (r, i)
    for s in range(n):
        for mb in range(m):
            have = {k: Action(s, k, mb) in where for k in ("F", "B", "I", "W")}
            missing = ("F" if not have["F"] else "I" if have["W"] and not have["I"]
                       else "W" if have["I"] and not have["W"] else "B" if not (have["B"] or have["I"]) else None)
            if missing:
                raise PlanError(f"no {missing} for stage {s} microbatch {mb}", plan.rank_of(s), None, "count")
            if have["B"] and have["I"]:
                raise PlanError(f"stage {s} microbatch {mb} has both B and I", *where[Action(s, "I", mb)], "count")
    return where


def _producers(a: Action, n: int, where) -> list[tuple[Action, str]]:
    """The compute actions whose results ``a`` needs, with the rule that orders them."""
    s, mb = a.stage, a.microbatch
    if a.kind == "F":
        return [(Action(s - 1, "F", mb), "forward")] if s > 0 else []
    if a.kind in ("B", "I"):
        out = [(Action(s, "F", mb), "own")]
        if s < n - 1:
            up = Action(s + 1, "B", mb)
            out.append((up if up in where else Action(s + 1, "I", mb), "backward"))
        return out
    if a.kind == "W":
        return [(Action(s, "I", mb), "w")]
    return []


def dependencies(plan, where) -> dict[tuple[int, int], list[tuple[tuple[int, int], str]]]:
    """For each (rank, position), the positions it waits for beyond its rank's order."""
    n = plan.n_stages
    deps: dict[tuple[int, int], list[tuple[tuple[int, int], str]]]
    deps = {(r, i): [] for r, row in enumerate(plan.actions) for i in range(len(row))}
    for r, row in enumerate(plan.actions):  # compute actions first: a missing receive is named there
        for i, a in enumerate(row):
            for p, rule in _producers(a, n, where):
                pr, pi = where[p]
                if pr == r:
                    if pi > i:
                        raise PlanError(f"{a} comes before {p} at position {pi}", r, i, rule)
                elif plan.lowered:
                    recv = inputs_of(a, n)
                    if recv not in where or where[recv][1] > i:
                        raise PlanError(f"{a} needs {recv} before it (its input comes from {p} on rank {pr})",
                                        r, i, "recv")
                    send = outputs_of(p, n)
                    if send not in where:
                        raise PlanError(f"{p} produces {a}'s input but no {send} follows it", pr, pi, "send")
                else:
                    deps[(r, i)].append(((pr, pi), rule))
    for r, row in enumerate(plan.actions):
        for i, a in enumerate(row):
            if not a.is_comm:
                continue
            other = match(a)
            if other not in where:
                raise PlanError(f"{a} has no matching {other} on rank {plan.rank_of(other.stage)}", r, i, "send")
            if a.kind in ("RF", "RB"):
                deps[(r, i)].append((where[other], "match"))
                continue
            kinds = "F" if a.kind == "SF" else "BI"
            made = next(b for b in (Action(a.stage, k, a.microbatch) for k in kinds) if b in where)
            if where[made][1] > i:
                raise PlanError(f"{a} comes before {made}, the compute that produces what it sends", r, i, "send")
    return deps


def _fifo(plan) -> None:
    """Per (sender, receiver) pair, the receiver's receives come in the sender's send order."""
    sent: dict[tuple[int, int], list[Action]] = {}
    for r, row in enumerate(plan.actions):
        for a in row:
            if a.kind in ("SF", "SB"):
                sent.setdefault((r, plan.rank_of(match(a).stage)), []).append(a)
    got: dict[tuple[int, int], int] = {}
    for r, row in enumerate(plan.actions):
        for i, a in enumerate(row):
            if a.kind in ("RF", "RB"):
                src = plan.rank_of(match(a).stage)
                k = got.get((src, r), 0)
                expected = sent[(src, r)][k]
                if expected != match(a):
                    raise PlanError(f"{a} receives {match(a)} but the next message rank {src} sends to rank {r} "
                                    f"is {expected}", r, i, "fifo")
                got[(src, r)] = k + 1


def format_grid(rows: list[tuple[str, list[str]]], header: str = "step") -> str:
    """Text table: one row per timestep, one column per rank."""
    pp = max((len(c) for _, c in rows), default=0)
    width = max([8] + [len(x) for _, cells in rows for x in cells])
    label = max([len(header)] + [len(tag) for tag, _ in rows])
    lines = [f"{header:>{label}} | " + " | ".join(f"{'rank ' + str(r):<{width}}" for r in range(pp))]
    lines += [f"{tag:>{label}} | " + " | ".join(f"{x:<{width}}" for x in cells) for tag, cells in rows]
    return "\n".join(line.rstrip() for line in lines)


def _step(plan, deps):
    """Lockstep run: (rows of actions per timestep, positions where the ranks stopped)."""
    pos, done, rows = [0] * plan.pp, set(), []
    while any(pos[r] < len(plan.actions[r]) for r in range(plan.pp)):
        ran = [(r, pos[r]) for r in range(plan.pp) if pos[r] < len(plan.actions[r])
               and all(d in done for d, _ in deps[(r, pos[r])])]
        if not ran:
            break
        row: list[Action | None] = [None] * plan.pp
        for r, i in ran:
            row[r] = plan.actions[r][i]
            done.add((r, i))
            pos[r] += 1
        rows.append(row)
    return rows, pos, done


def steps(plan) -> list[list[Action | None]]:
    """The plan run in lockstep: per timestep, the action each rank runs (None = waiting or done).

    Raises ``PlanError`` where ``check`` would.
    """
    check(plan)
    return _step(plan, dependencies(plan, positions(plan)))[0]


def _stuck(plan, deps, rows, pos, done) -> PlanError:
    cells = [(str(t), [str(a) if a else "." for a in row]) for t, row in enumerate(rows)][-6:]
    waits, why = [], []
    for r in range(plan.pp):
        if pos[r] >= len(plan.actions[r]):
            waits.append("done")
            continue
        a = plan.actions[r][pos[r]]
        waits.append(f"waits {a}")
        for (dr, di), rule in deps[(r, pos[r])]:
            if (dr, di) not in done:
                blocker = plan.actions[dr][pos[dr]] if pos[dr] < len(plan.actions[dr]) else None
                why.append(f"rank {r} position {pos[r]}: {a} waits for {plan.actions[dr][di]} ({RULES[rule]}), "
                           f"at rank {dr} position {di} behind {blocker}")
    cells.append((str(len(rows)), waits))
    first = next(r for r in range(plan.pp) if pos[r] < len(plan.actions[r]))
    return PlanError(f"plan deadlocks at timestep {len(rows)}: no rank can run its next action",
                     first, pos[first], "deadlock", format_grid(cells) + "\n" + "\n".join(why))


def check(plan):
    """Raise ``PlanError`` unless ``plan`` is complete, well ordered and runs to the end; returns the plan."""
    checked(plan)
    return plan


def checked(plan) -> tuple:
    """``check(plan)``, returning what it found on the way: each position's dependencies and the lockstep rows
    (``_step``), which ``simulate.prepare`` times the plan on."""
    where = positions(plan)
    deps = dependencies(plan, where)
    rows, pos, done = _step(plan, deps)
    if any(pos[r] < len(plan.actions[r]) for r in range(plan.pp)):
        raise _stuck(plan, deps, rows, pos, done)
    if plan.lowered:
        _fifo(plan)
    return deps, rows
