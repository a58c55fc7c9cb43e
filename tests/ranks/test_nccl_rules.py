"""The nccl_rules backend catches each thing gloo forgives and NCCL does not, and each violating program
completes on plain gloo: so the rule, not luck, is what catches it.

One ``ck.launch`` of 2 ranks per backend runs every program in turn, each on a group of its own (a program that
breaks its group leaves the next one a clean group); the gloo launch runs the same programs and shows that they
complete there. The pipeline under the rules (every schedule, the compositions, HF MoE's side band) is tested
where the pipeline is (tests/ranks/test_pipeline_engine.py, test_parity_matrix.py, test_hf_moe.py): this file is
about the rules themselves.
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest

import colab_kit as ck
from colab_kit.pipeline.order import message_order, send_timesteps

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _programs(backend: str) -> dict:
    """On each of 2 ranks: every violating program, each on a fresh group of ``backend``; what each saw."""
    import os

    import torch
    import torch.distributed as dist

    from colab_kit import comm
    from colab_kit.comm import rules

    me, other = dist.get_rank(), 1 - dist.get_rank()
    out: dict = {"backend": dist.get_backend()}

    def group(device=None):
        if device:
            os.environ["COLAB_KIT_RULES_DEVICE"] = device
        try:
            return dist.new_group([0, 1], backend=backend)
        finally:
            os.environ.pop("COLAB_KIT_RULES_DEVICE", None)

    def attempt(name, fn):
        try:
            out[name] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test reads
            out[name] = (type(exc).__name__, str(exc))

    # 1. tags: rank 0 sends a (tag 1) then b (tag 2); rank 1 asks for tag 2 first. gloo matches by tag.
    g = group()

    def reorder():
        a, b = torch.full((3,), 1.0), torch.full((3,), 2.0)
        if me == 0:  # both posted at once: gloo holds a send until its receive is posted
            for w in [dist.isend(t, 1, group=g, tag=tag) for t, tag in ((a, 1), (b, 2))]:
                w.wait()
            return None
        first, second = torch.empty(3), torch.empty(3)
        dist.recv(first, 0, group=g, tag=2)
        dist.recv(second, 0, group=g, tag=1)
        return first.tolist(), second.tolist()
    attempt("reorder", reorder)

    # 1'. the same with two shapes: NCCL's n-th receive gets the n-th send, whatever its size
    g = group()

    def reorder_shapes():
        if me == 0:
            for w in [dist.isend(torch.ones(4), 1, group=g, tag=1), dist.isend(torch.ones(2), 1, group=g, tag=2)]:
                w.wait()
            return None
        small, big = torch.empty(2), torch.empty(4)
        works = [dist.irecv(small, 0, group=g, tag=2), dist.irecv(big, 0, group=g, tag=1)]
        errors = []
        for w in works:  # both waited: each message is taken, so the sender's sends complete
            try:
                w.wait()
            except RuntimeError as exc:
                errors.append(str(exc))
        if errors:
            raise RuntimeError(" | ".join(errors))
        return small.tolist(), big.tolist()
    attempt("reorder_shapes", reorder_shapes)

    # 2. one pair, one stream: each rank posts its receive, then its send, to the other
    g = group()

    def recv_first():
        got = torch.empty(2)
        r = dist.irecv(got, other, group=g)
        s = dist.isend(torch.full((2,), float(me)), other, group=g)
        for w in (r, s):
            comm.finish(w, timeout=3.0)
        return got.tolist()
    attempt("recv_first", recv_first)
    out["pending"] = rules.pending() if backend == "nccl_rules" else []
    if backend == "nccl_rules":
        g.shutdown()  # NCCL would abort the communicator: its ops error out instead of staying blocked

    # 2'. the same two messages as one batch (NCCL's group): fine under the rules too
    g = group()

    def batched():
        got = torch.empty(2)
        ops = [dist.P2POp(dist.irecv, got, other, g), dist.P2POp(dist.isend, torch.full((2,), float(me)), other, g)]
        for w in rules.batch_isend_irecv(ops):
            w.wait()
        return got.tolist()
    attempt("batched", batched)

    # 2''. the same batch through torch's own function, as libraries call it (torch's pipelining schedules):
    # torch runs a Python group's batch as separate messages, which the pair order would hold back; register()
    # routes it to the rules' batch, so it passes here as on NCCL
    g = group()

    def torch_batched():
        got = torch.empty(2)
        ops = [dist.P2POp(dist.irecv, got, other, g), dist.P2POp(dist.isend, torch.full((2,), float(me)), other, g)]
        for w in dist.batch_isend_irecv(ops):
            comm.finish(w, timeout=3.0)
        return got.tolist()
    attempt("torch_batched", torch_batched)

    # 3. collectives in different orders: the same bytes, so gloo adds them up without a word
    g = group()

    def crossed():
        x, y = torch.ones(4), torch.ones(2, 2)
        for t in ((x, y) if me == 0 else (y, x)):
            dist.all_reduce(t, group=g)
        return x.tolist()
    attempt("crossed", crossed)

    # 3'. two different collectives that gloo would hang on: the watchdog names them within a second or so
    if backend == "nccl_rules":
        g = group()

        def different():
            t = torch.ones(4)
            if me == 0:
                dist.all_reduce(t, group=g)
            else:
                dist.broadcast(t, 1, group=g)
        attempt("different", different)
        g.shutdown()

    # 4. the device rule: a CPU tensor handed to a group whose job runs on the GPU
    g = group(device="cuda") if backend == "nccl_rules" else group()
    attempt("device", lambda: dist.all_reduce(torch.ones(2), group=g))

    # 5. contiguous tensors: a transposed view all-reduced (gloo sums it in place, as a view)
    g = group()

    def strided():
        x = torch.arange(6.0).reshape(2, 3).t()  # (3, 2), strides (1, 3)
        dist.all_reduce(x, group=g)
        return x.tolist()

    attempt("contiguous", strided)
    return out


@pytest.fixture(scope="module")
def outcomes():
    return {b: ck.launch(_programs, 2, b, backend=b, timeout=120) for b in ("nccl_rules", "gloo")}


def test_the_rules_are_the_default_on_cpu(outcomes):
    assert ck.launch(lambda: __import__("torch.distributed").distributed.get_backend(), 2) == ["nccl_rules"] * 2
    assert [o["backend"] for o in outcomes["gloo"]] == ["gloo"] * 2


def test_tags_are_ignored(outcomes):
    # gloo matches by tag: rank 1 gets b then a, as asked
    assert outcomes["gloo"][1]["reorder"] == ("ok", ([2.0] * 3, [1.0] * 3))
    # NCCL (and the rules) by order: the first receive gets a, whatever its tag said
    assert outcomes["nccl_rules"][1]["reorder"] == ("ok", ([1.0] * 3, [2.0] * 3))
    assert outcomes["gloo"][1]["reorder_shapes"] == ("ok", ([1.0] * 2, [1.0] * 4))
    kind, text = outcomes["nccl_rules"][1]["reorder_shapes"]  # 4 floats arriving into a buffer of 2, then 2 into 4
    assert "message 0 from rank 0 is float32[4] (16 bytes), but the receive it met is float32[2] (8 bytes)" in text
    assert "message 1 from rank 0 is float32[2] (8 bytes)" in text, text


def test_a_receive_posted_first_holds_back_the_send_after_it(outcomes):
    for rank in range(2):
        assert outcomes["gloo"][rank]["recv_first"] == ("ok", [float(1 - rank)] * 2)
        kind, text = outcomes["nccl_rules"][rank]["recv_first"]
        assert kind == "WaitTimeout", (kind, text)
        pending = " ".join(outcomes["nccl_rules"][rank]["pending"])
        # the report names both, the receive running and the send queued behind it
        assert f"recv float32[2] from rank {1 - rank} (running" in pending, pending
        assert f"send float32[2] to rank {1 - rank} (queued" in pending, pending
        # posted together, as one group, the same two messages pass: through the rules' batch_isend_irecv and
        # through torch's own, which register() routes to it
        assert outcomes["nccl_rules"][rank]["batched"] == ("ok", [float(1 - rank)] * 2)
        assert outcomes["nccl_rules"][rank]["torch_batched"] == ("ok", [float(1 - rank)] * 2)
        assert outcomes["gloo"][rank]["torch_batched"] == ("ok", [float(1 - rank)] * 2)


def test_collectives_must_match_on_every_rank(outcomes):
    for rank in range(2):
        assert outcomes["gloo"][rank]["crossed"] == ("ok", [2.0] * 4)
        kind, text = outcomes["nccl_rules"][rank]["crossed"]
        assert kind == "RuleBroken", (kind, text)
        assert "rank 0 called all_reduce(sum) float32[4]" in text and "rank 1 called all_reduce(sum) float32[2, 2]" \
            in text, text
        kind, text = outcomes["nccl_rules"][rank]["different"]
        assert kind == "RuleBroken" and "all_reduce(sum) float32[4]" in text and "broadcast(root 1)" in text, text


def test_tensors_must_be_on_the_device(outcomes):
    for rank in range(2):
        assert outcomes["gloo"][rank]["device"][0] == "ok"
        kind, text = outcomes["nccl_rules"][rank]["device"]
        assert kind == "RuleBroken" and "cpu tensor float32[2]" in text and "run on cuda" in text, text


def test_tensors_must_be_contiguous(outcomes):
    for rank in range(2):
        kind, summed = outcomes["gloo"][rank]["contiguous"]
        assert kind == "ok" and summed == [[0.0, 6.0], [2.0, 8.0], [4.0, 10.0]], summed  # gloo: done, as a view
        kind, text = outcomes["nccl_rules"][rank]["contiguous"]
        assert kind == "RuleBroken" and "non-contiguous tensor float32[3, 2]" in text and "(1, 3)" in text, text


def _torch_pipelining() -> dict:
    """torch.distributed.pipelining's GPipe and 1F1B, 2 stages of two Linear layers each, 4 microbatches, on the
    launch's backend (nccl_rules): rank 1's losses and each rank's gradients."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    me, out = dist.get_rank(), {}
    x, y = (torch.randn(8, 6, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2))
    for name, kind in (("gpipe", ScheduleGPipe), ("1f1b", Schedule1F1B)):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(6, 6) for _ in range(4)]
        mine = torch.nn.Sequential(*layers[2 * me:2 * me + 2])
        stage = PipelineStage(mine, me, 2, torch.device("cpu"))
        schedule = kind(stage, n_microbatches=4, loss_fn=lambda out, target: ((out - target) ** 2).mean())
        losses: list = []
        if me == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        out[name] = ([float(v) for v in losses], [p.grad.clone() for p in mine.parameters()])
    return out


def test_torchs_own_pipelining_trains_under_the_rules():
    """torch's schedules batch each exchange with torch.distributed.batch_isend_irecv; under the rules it is one
    NCCL group (register() routes it), so GPipe and 1F1B finish and match one process."""
    import torch

    got = ck.launch(_torch_pipelining, 2, timeout=120)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 6) for _ in range(4)]
    model = torch.nn.Sequential(*layers)
    x, y = (torch.randn(8, 6, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2))
    losses = [((model(xm) - ym) ** 2).mean() for xm, ym in zip(x.chunk(4), y.chunk(4))]
    (sum(losses) / 4).backward()
    want = [p.grad for p in model.parameters()]
    for name in ("gpipe", "1f1b"):
        assert got[1][name][0] == pytest.approx([float(v.detach()) for v in losses], rel=1e-6)
        grads = got[0][name][1] + got[1][name][1]
        assert len(grads) == len(want)
        for g, w in zip(grads, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        assert not torch.allclose(grads[0], 2 * want[0])  # the check can fail: gradients summed, not averaged


def _waits(budget: float) -> dict:
    """On each of 2 ranks, under polling budget ``budget`` (s): all-reduces, a batch and unbatched messages;
    the results, and what the rules' waits polled (``comm.spin``, counted by the kind of its look)."""
    import torch
    import torch.distributed as dist

    from colab_kit.comm import rules, spin as spin_mod
    from colab_kit.comm.rules import works

    spin_mod.SPIN_SECONDS = budget
    looks: dict = {}
    real = works.spin

    def counted(done, b=None):
        kind = type(getattr(done, "__self__", done)).__name__
        looks[kind] = looks.get(kind, 0) + 1
        return real(done, b)
    works.spin = counted
    me, other = dist.get_rank(), 1 - dist.get_rank()
    sums = []
    for k in range(20):
        t = torch.arange(4.0) * (me + 1) + k
        dist.all_reduce(t)
        sums.append(t.tolist())
    got = torch.empty(3)
    ops = [dist.P2POp(dist.irecv, got, other), dist.P2POp(dist.isend, torch.full((3,), me + 1.0), other)]
    for w in rules.batch_isend_irecv(ops):
        w.wait()
    echo = torch.empty(2)
    if me == 0:
        dist.send(torch.tensor([5.0, 6.0]), 1)
        dist.recv(echo, 1)
    else:
        dist.recv(echo, 0)
        dist.send(echo * 2, 0)
    works.spin = real
    return {"sums": sums, "got": got.tolist(), "echo": echo.tolist(), "looks": looks}


def test_waits_poll_first_and_give_the_same_results_as_sleeping():
    """A rules collective's wait polls gloo's work first on the rank's thread (``comm.spin``, ``bench/spin.py``
    measures what it saves), a message's sleeps at once; with a budget of 0 (``COLAB_KIT_SPIN_US=0``) every wait
    sleeps at once. Either way every sum and message is the same, and matches what the ranks sent."""
    polling, sleeping = (ck.launch(_waits, 2, budget, timeout=120) for budget in (1e-3, 0.0))
    for r in range(2):
        assert polling[r]["sums"] == sleeping[r]["sums"] == [[3 * i + 2 * k for i in range(4)] for k in range(20)]
        assert polling[r]["got"] == sleeping[r]["got"] == [2.0 - r] * 3
        assert polling[r]["looks"] == sleeping[r]["looks"]
        assert sum(polling[r]["looks"].values()) >= 20  # each all-reduce's wait looked at gloo's work first
        assert "Future" not in polling[r]["looks"]  # a message's wait sleeps at once (a channel completes it)
    assert polling[0]["echo"] == sleeping[0]["echo"] == [10.0, 12.0]
    assert polling[1]["echo"] == [5.0, 6.0]


# --------------------------------------------------------------------------- the pipeline's order, in one process
@pytest.mark.parametrize("schedule,pp,m,chunks", [("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1),
                                                  ("interleaved", 2, 4, 2), ("zb-h1", 4, 6, 1), ("zb-v", 2, 4, 2),
                                                  ("zb-v", 4, 8, 2)])
def test_both_ends_of_every_pair_issue_the_same_messages_in_the_same_order(schedule, pp, m, chunks):
    """What ``message_order`` gives each rank, read per pair: rank a's messages with b are rank b's with a, one
    for one, sends against receives; and each rank's sends keep the order of its action list."""
    from colab_kit.pipeline import build_plan
    from colab_kit.pipeline.check import steps
    from colab_kit.pipeline.lowering import lower, match

    plan = lower(build_plan(schedule, pp, m, chunks))
    rows = steps(plan)
    timesteps = [[t for t, row in enumerate(rows) if row[r] is not None] for r in range(pp)]
    sent_at = send_timesteps(plan, timesteps)
    orders = [message_order(plan, r, plan.actions[r], sent_at, header=lambda a: a.microbatch == 0, side=True)
              for r in range(pp)]
    for a in range(pp):
        sends = [msg.action for msg in orders[a] if msg.send and msg.part == "data"]
        assert sends == [x for x in plan.actions[a] if x.kind in ("SF", "SB")]
        for b in range(pp):
            mine = [(msg.action if msg.send else match(msg.action), msg.part) for msg in orders[a] if msg.peer == b]
            theirs = [(msg.action if msg.send else match(msg.action), msg.part) for msg in orders[b] if msg.peer == a]
            assert mine == theirs, (schedule, a, b)


def test_the_action_lists_own_order_would_not_do():
    """The check above can fail: 1F1B's action lists, read per pair, disagree (rank 0 sends microbatch 1's
    activation before it takes microbatch 0's gradient; rank 1 sends that gradient before it takes that
    activation), which is what hung under the rules before ``message_order``."""
    from colab_kit.pipeline import build_plan
    from colab_kit.pipeline.lowering import lower, match

    plan = lower(build_plan("1f1b", 2, 4))
    seen = [[a if a.kind in ("SF", "SB") else match(a) for a in plan.actions[r] if a.is_comm] for r in range(2)]
    assert seen[0] != seen[1] and sorted(map(str, seen[0])) == sorted(map(str, seen[1]))


def test_a_peer_that_has_not_opened_the_board_yet_has_written_nothing():
    """The shared board's rows read "not written" until their rank writes: a board file starts as zeros, which
    would read as collective 0 with an all-zero fingerprint ("all_reduce(sum) float32[]"), so a rank that compared
    its first collective before its peer had opened the board failed with a difference nobody made (seen once, a
    group of a second mesh in tests/ranks/test_comm.py under load). In one process, no ranks: rank 0 opens, writes
    and reads collective 0 before rank 1 has opened."""
    import torch.distributed as dist

    from colab_kit.comm.rules.board import Board

    store = dist.HashStore()
    first = Board(store, 0, 2, 3)
    first.write(0, [1, 2, 3])
    assert first.read(0) == [[1, 2, 3], None]
    second = Board(store, 1, 2, 3)
    assert second.read(0) == [[1, 2, 3], None]
    second.write(0, [1, 2, 3])
    assert first.read(0) == [[1, 2, 3], [1, 2, 3]]
    first.close()
    second.close()
