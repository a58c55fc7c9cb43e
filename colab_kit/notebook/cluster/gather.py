"""Sending to and waiting for the ranks of a ``Cluster``: failures, deaths, timeouts and Ctrl-C.

One call to the cluster is one ipyparallel AsyncResult per rank. ``Waiting.gather``
waits for them and decides what the caller is told::

    all finished                           -> {rank: result}
    rank 1 raised, ranks 0, 2, 3 waited    -> RankError, rank 1 first; after ``grace`` s the
                                              waiting ranks are given up on and the cluster is
                                              marked for restart (its process group is unusable)
    rank 2's engine was killed             -> RankError that blames rank 2 first (its engine is
                                              gone), never a peer that only saw its connection drop
    nobody failed, ``timeout`` passed      -> RankTimeout; the ranks keep running (cluster busy)
    Ctrl-C (KeyboardInterrupt)             -> SIGINT to the running ranks through ipyparallel,
                                              then a health check that runs no collective: each
                                              rank's collective count per group; a rank that does
                                              not answer, or counts that differ, mark the cluster
                                              for restart
    the controller process died            -> ClusterError at once, never a wait forever
"""
from __future__ import annotations

import concurrent.futures as cf
import re
import signal
import time
from typing import TYPE_CHECKING, Any

from ...errors import MessageOnly, RankError, RankTimeout, stacks
from ...launch import seconds_refusal
from . import forked, remote, ssh_forked
from .watchdog import has_ended
from .results import RankTable, split, unwrap_plain

__all__ = ["Waiting", "RESTART_ADVICE", "ClusterError"]

COMM_FAILURE = re.compile(r"DistBackendError|RuleBroken|PipelineHang|WaitTimeout|NCCL error|"
                          r"gloo[^\n]*(Timed out|Connection closed|Connection reset|timeout caused pair closure)")
"""A rank's error text that says it failed inside a collective (torch's backend or colab_kit's comm said so, not
a user's own socket): the process group is unusable after it."""
RESTART_ADVICE = ("the cluster's process group is now unusable: run %colossal restart (or cluster.restart()) "
                  "to get fresh engines with the same config")
HEALTH_SECONDS = 5.0


def out_of_step(reports: dict[int, dict]) -> str:
    """Why ranks' ``remote.health`` reports show them at different collectives ('' when in step): a group whose
    ranks issued different numbers of collectives, or operations issued and not complete.

        >>> out_of_step({0: {"seq": {"0": 5, "1": 2}, "pending": []}, 1: {"seq": {"0": 5}, "pending": []}})
        ''
        >>> out_of_step({0: {"seq": {"0": 5}, "pending": []}, 1: {"seq": {"0": 4}, "pending": []}})
        'group 0: rank 0 issued 5 collectives, rank 1 issued 4 collectives'
    """
    seen: dict[str, dict[int, int]] = {}
    for r, rep in sorted(reports.items()):
        for name, seq in (rep.get("seq") or {}).items():
            seen.setdefault(name, {})[r] = seq
    why = [f"group {name}: " + ", ".join(f"rank {r} issued {n} collectives" for r, n in by.items())
           for name, by in seen.items() if len(set(by.values())) > 1]
    why += [f"rank {r} has {p}" for r, rep in sorted(reports.items()) for p in (rep.get("pending") or [])[:3]]
    return "; ".join(why)


class ClusterError(MessageOnly, RuntimeError):
    """The cluster cannot do what was asked (not started, failed to start, needs a restart).
    IPython shows its message only: the kernel-side frames say nothing the message does not."""


class Waiting:
    """The sending and waiting half of ``Cluster`` (needs ``_client``, ``_ids``, ``world_size``,
    ``running``, ``_controller_procs``, ``grace``, ``timeout``, ``_broken``, ``_busy``)."""

    # the fields of ``Cluster`` this half uses (``Cluster.__init__`` sets them)
    _client: Any  # ipyparallel's Client, None until started
    _ids: list[int]
    _table: RankTable
    _controller_procs: list
    _broken: str | None
    _busy: dict[int, Any]
    grace: float
    timeout: float
    _relays: frozenset = frozenset()
    """Ranks whose engine relays what it writes to fd 2 as the running call's output (``remote.probe``'s
    "relays"): only their stacks can come back to ``_where``."""

    if TYPE_CHECKING:
        @property
        def running(self) -> bool: ...

        @property
        def world_size(self) -> int: ...

    def _controller_dead(self) -> bool:
        """Whether a process of the controller (started by this kernel) has ended."""
        return any(has_ended(proc) for proc in self._controller_procs)

    def _whereabouts(self, rank: int) -> str:
        """`` (on host "b", pid 41)`` for a rank of the ranks table; nothing before the table exists."""
        row = next((row for row in self._table if row["rank"] == rank), None)
        return f" (on host {row['host']!r}, pid {row['pid']})" if row else ""

    def _how_it_ended(self, rank: int) -> str:
        """"killed by SIGKILL (...)", "exited with code 3 (...)" for an engine one of this kernel's fork servers
        forked (``forked.exit_code`` here, ``ssh_forked.exit_code`` on an SSH host), else "killed, crashed or
        out of memory"."""
        import socket

        row = next((row for row in self._table if row["rank"] == rank), None)
        if row is None:
            return forked.how_it_ended(None)
        code = ssh_forked.exit_code(row["host"], row["pid"])
        if code is None and row["host"] == socket.gethostname():  # a pid on another host is another process
            code = forked.exit_code(row["pid"])
        return forked.how_it_ended(code)

    def _dead_ranks(self, ranks) -> list[int]:
        """Ranks whose engine has unregistered (the engine's nanny tells the controller at once)."""
        alive = set(self._client.ids)
        return [r for r in ranks if self._ids[r] not in alive]

    def _signal(self, ranks, sig) -> None:
        """``sig`` to the engines of ``ranks`` through ipyparallel (their nannies relay it, on any host)."""
        ids = [self._ids[r] for r in ranks if self._ids[r] in self._client.ids]
        if ids:
            try:
                self._client.send_signal(sig, targets=ids, block=False)
            except Exception:  # noqa: BLE001 - an engine that is gone cannot be signalled
                pass

    def _interrupt(self, pending: dict) -> None:
        """Pass a Ctrl-C on to the ranks still running; then check that every rank is in step."""
        self._signal(list(pending), signal.SIGINT)
        cf.wait(list(pending.values()), timeout=self.grace)
        still = sorted(r for r, ar in pending.items() if not ar.ready())
        self._busy = {}
        if still:
            self._broken = f"ranks {still} did not stop when interrupted (blocked in a collective?)"
            return
        self.health_check()

    def health_check(self, seconds: float = HEALTH_SECONDS) -> bool:
        """Every rank says where its collectives stand (``remote.health``: no collective runs, so ranks stopped
        at different ones cannot hang it); a rank that does not answer, or ranks out of step, mark the cluster
        for restart."""
        ranks = list(range(len(self._ids)))
        ars = self._apply(ranks, remote.health, seconds)
        done, _ = cf.wait(list(ars.values()), timeout=seconds + self.grace)
        answers = {r: unwrap_plain(ar) for r, ar in ars.items() if ar in done}
        bad = sorted(r for r in ranks if r not in answers or not answers[r][0])
        if bad:
            self._broken = f"ranks {bad} failed the health check after an interrupt (no answer)"
            return False
        why = out_of_step({r: dict(answers[r][1]) for r in ranks})  # type: ignore[call-overload]
        if why:
            self._broken = f"the ranks are out of step after an interrupt: {why}"
        return not why

    def _gather(self, ars: dict, timeout: float | None, where: str, unwrap=None, tick=None,
                cell: str | None = None) -> dict:
        """Wait for one AsyncResult per rank; give up on the rest ``grace`` s after a failure. ``cell``: the code
        the ranks run (``execute``), for saying where a stuck rank is in it."""
        unwrap = unwrap or unwrap_plain
        t0 = time.monotonic()
        deadline = float("inf") if timeout is None else t0 + timeout
        pending, results, failures = dict(ars), {}, {}
        try:
            while pending and time.monotonic() < deadline:
                left = min(deadline - time.monotonic(), 1.0)
                done, _ = cf.wait(list(pending.values()), timeout=max(left, 0), return_when=cf.FIRST_COMPLETED)
                if not done and self._controller_dead():
                    self._broken = "the ipyparallel controller process exited"
                    raise ClusterError(f"{self._broken} while ranks {sorted(pending)} ran {where}: "
                                       "stop the cluster and start a new one (%colossal stop, %colossal start)")
                if tick is not None and not done:
                    tick(time.monotonic() - t0)
                for rank in [r for r, ar in pending.items() if ar in done]:
                    ok, value = unwrap(pending.pop(rank))
                    if ok:
                        results[rank] = value
                    else:
                        failures[rank] = value
                        deadline = min(deadline, time.monotonic() + self.grace)
        except KeyboardInterrupt:  # Ctrl-C or the notebook's stop button
            self._interrupt(pending)
            raise
        if failures:
            self._raise_failures(failures, pending, where, targets=sorted(ars), cell=cell)
        if pending:
            assert timeout is not None  # without one the loop above ends only when every rank has answered
            self._busy = pending
            said = self._where(pending, cell=cell)
            raise RankTimeout(sorted(pending), timeout, where,
                              "they are still running it: wait for them (%colossal status), or run "
                              "%colossal restart (cluster.restart()) to stop them" + (f"\n{said}" if said else ""))
        return results

    def _raise_failures(self, failures: dict, pending: dict, where: str, targets: list[int] | None = None,
                        cell: str | None = None):
        """RankError with the dead engines first: a peer's "connection closed" is their consequence. A failure
        inside a collective (a timeout, a closed connection, ranks out of step) leaves the process group unusable:
        the cluster is marked for restart, and a call on some ranks only (``--ranks``) is said to be the likely
        cause (a collective of a group with other ranks waits for ranks that never enter it)."""
        died = [r for r, text in failures.items() if text.startswith("EngineError")]
        for r in self._dead_ranks(sorted(pending)):  # dead, but the controller has not said so yet
            failures[r] = "EngineError: this rank's engine process died while running the call"
            pending.pop(r)
            died.append(r)
        for r in died:  # how it ended (a local engine forked by this kernel), and where: the first things to look at
            failures[r] += f" ({self._how_it_ended(r)})" + self._whereabouts(r)
        ordered = {r: failures[r] for r in died} | {r: t for r, t in failures.items() if r not in died}
        advice = ""
        in_collective = [r for r, text in ordered.items() if COMM_FAILURE.search(text)]
        if pending or died or in_collective:
            self._broken = (f"the engines of ranks {sorted(died)} died in {where}" if died else
                            f"rank {next(iter(ordered))} failed in {where} while ranks {sorted(pending)} waited"
                            if pending else f"rank {in_collective[0]} failed inside a collective in {where}")
            advice = RESTART_ADVICE
        some = targets is not None and len(targets) < len(self._ids)
        if in_collective and some:
            others = sorted(set(range(len(self._ids))) - set(targets or []))
            advice = (f"  this ran on ranks {targets} only: a collective of a group that holds ranks {others} too "
                      "(an engine's step or generate under tp, pp or dp) waits for ranks that never enter it; run "
                      f"it on every rank (without --ranks / ranks=)\n{advice}")
        finished = sorted(set(targets or []) - set(failures) - set(pending))
        if in_collective and finished and not some:
            advice = (f"  ranks {finished} finished this call without entering the collective ranks "
                      f"{sorted(in_collective)} waited in: every rank of a group must call each of its collectives, "
                      "in the same order (is one under `if rank == ...:`, or after a return some ranks take?)\n"
                      f"{advice}")
        said = self._where(pending, cell=cell) if pending else ""
        raise RankError(ordered, sorted(pending), where, f"{advice}\n{said}" if said and advice else said or advice)

    def _where(self, pending: dict, wait: float = 2.0, cell: str | None = None) -> str:
        """Where each rank still running is (``errors.stacks.describe``): asked for its Python stack by SIGUSR1
        (``faulthandler``, armed by ``remote.probe``), which it writes to its stderr; ipyparallel relays that as the
        call's output, read here. "" where none answered within ``wait`` seconds, at once where no rank's engine
        relays its fd 2 (ipykernel does not under pytest; a launcher may not): the dump then goes to its log."""
        def text(ar) -> str:
            err = ar.stderr
            return "".join(err) if isinstance(err, list) else (err or "")

        before = {r: len(text(ar)) for r, ar in pending.items()}
        self._signal(list(pending), signal.SIGUSR1)
        if not self._relays.intersection(pending):
            return ""
        seen: dict = {}  # rank -> when its dump began to arrive
        found: dict = {}
        end = time.monotonic() + wait
        while len(found) < len(pending) and time.monotonic() < end:
            time.sleep(0.1)
            for r, ar in pending.items():
                new = text(ar)[before[r]:]
                if r in found or "most recent call first" not in new:
                    continue
                seen.setdefault(r, time.monotonic())
                if time.monotonic() - seen[r] >= 0.3:  # the dump arrives in pieces: read it whole
                    found[r] = stacks.user_frames(new)
        return stacks.describe({r: f for r, f in found.items() if f}, cell=cell)

    # ------------------------------------------------------------ sending
    def _view(self, ranks: list[int]):
        """One DirectView on the engines of ``ranks``: a call is serialised once for all of them."""
        ids = [self._ids[r] for r in ranks]
        gone = [r for r, i in zip(ranks, ids) if i not in self._client.ids]
        if gone:
            self._broken = f"the engines of ranks {gone} are gone (killed, or out of memory?)"
            raise ClusterError(f"{self._broken}: run %colossal restart (or cluster.restart()) for fresh engines")
        return self._client[ids[0] if len(ids) == 1 else ids]  # one engine: plain results, not lists

    def _apply(self, ranks: list[int], fn, *args) -> dict:
        """``fn(*args)`` on ``ranks``: rank -> AsyncResult."""
        return split(self._view(ranks).apply_async(fn, *args), ranks)

    def _targets(self, ranks: list[int] | int | None, timeout: float | None = None) -> list[int]:
        """The ranks a call goes to (all for None; one rank may be given as a number), and its ``timeout``,
        checked before anything is sent."""
        if timeout is not None:
            why = seconds_refusal("timeout", timeout)
            if why is not None:
                raise ClusterError(f"{why}, or None to wait until every rank is done")
        self._check_usable()
        if ranks is None:
            return list(range(self.world_size))
        if isinstance(ranks, int) and not isinstance(ranks, bool):
            ranks = [ranks]
        if isinstance(ranks, (str, bytes, bool)) or not hasattr(ranks, "__iter__"):
            raise ClusterError(f"ranks is a list of rank numbers, e.g. ranks=[0, 1], got {ranks!r}")
        ranks = list(ranks)
        bad = [r for r in ranks if isinstance(r, bool) or not (isinstance(r, int) and 0 <= r < self.world_size)]
        if bad or not ranks:
            raise ClusterError(f"ranks {bad or ranks} are not ranks of this cluster: "
                               f"choose among 0..{self.world_size - 1}")
        return sorted(set(ranks))

    def _check_usable(self) -> None:
        if not self.running:
            raise ClusterError("no cluster is running: start one with %colossal start -n 4 "
                               "(or ck.Cluster(n=4).start())")
        if self._broken:
            raise ClusterError(f"the cluster needs a restart: {self._broken}. Run %colossal restart "
                               "(or cluster.restart()) first")
        busy = sorted(r for r, ar in self._busy.items() if not ar.ready())
        if busy:
            raise ClusterError(f"ranks {busy} are still running a call that timed out, so new work would "
                               "queue behind it: wait for them (%colossal status), or run %colossal restart")
        self._busy = {}
