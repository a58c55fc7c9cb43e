"""Recorded collectives: values on every axis and the (op, axis, bytes) record of each call.

Tier 1 checks CommLog on its own; tier 2 runs every collective in ONE ``ck.launch`` of 4 ranks
with a ``dp=2, tp=2`` mesh (and a ``tp=4`` 2D mesh on the same ranks for the sub-axes). The
expected values are written out by hand from the groups: tp [[0,1],[2,3]], dp [[0,2],[1,3]],
and in 2D tp_col [[0,1],[2,3]], tp_row [[0,2],[1,3]].
"""
from __future__ import annotations

import sys
import time

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import colab_kit as ck
from colab_kit import comm
from colab_kit.comm import CommLog, CommRecord, Pending

cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --------------------------------------------------------------------------- tier 1: CommLog
def test_comm_log_records_summary_and_steps():
    log = CommLog()
    before = time.perf_counter()
    r = log.add("all_reduce", "dp", 4096, 0.5, tag="grads")
    assert r == CommRecord("all_reduce", "dp", 4096, 0.5, "grads")
    assert before <= r.end <= time.perf_counter() and r.waited is None  # stamped when recorded (for profiles)
    log.add("all_reduce", "dp", 1000, 0.25)
    log.begin_step()
    log.add("all_gather", "tp", 64.0, 1)  # numbers are normalised: int bytes, float seconds
    assert log.records[-1] == CommRecord("all_gather", "tp", 64, 1.0, "")
    assert type(log.records[-1].bytes) is int and type(log.records[-1].seconds) is float
    assert log.last_step() == [log.records[-1]]
    assert log.summary() == {
        "all_reduce@dp": {"count": 2, "bytes": 5096, "wire": 0, "seconds": 0.75},
        "all_gather@tp": {"count": 1, "bytes": 64, "wire": 0, "seconds": 1.0},
    }
    assert log.summary(log.last_step()) == {"all_gather@tp": {"count": 1, "bytes": 64, "wire": 0, "seconds": 1.0}}
    assert log.as_dicts(log.last_step()) == [
        {"op": "all_gather", "axis": "tp", "bytes": 64, "seconds": 1.0, "tag": "", "wire": 0}]
    log.add("all_reduce", "dp", 4096, 0.1, n=4)  # the group's size gives the wire bytes
    assert log.records[-1].wire == 6144
    assert len(log.as_dicts()) == 4


def test_comm_logs_are_independent():
    a, b = CommLog(), CommLog()
    a.add("broadcast", "dp", 1, 0.0)
    assert b.records == []


# --------------------------------------------------------------------------- tier 2: one launch
def _rows(log, start=0):
    return [(r.op, r.axis, r.bytes, r.tag) for r in log.records[start:]]


def comm_checks():
    rank = dist.get_rank()
    mesh = ck.ProcessMesh(ck.ParallelConfig(dp=2, tp=2))
    out = {}

    # all_reduce: in place, returns the same tensor
    t = torch.full((3,), float(rank + 1))                       # 3 x fp32 = 12 bytes
    out["ar_tp_same"] = comm.all_reduce(t, mesh, "tp") is t
    out["ar_tp"] = t.tolist()
    t = torch.full((2,), float(rank + 1), dtype=torch.float64)  # 2 x fp64 = 16 bytes
    comm.all_reduce(t, mesh, "dp", tag="grads")
    out["ar_dp"] = t.tolist()
    t = torch.tensor([float(rank)])                             # 4 bytes
    comm.all_reduce(t, mesh, "tp", op=dist.ReduceOp.MAX)
    out["ar_tp_max"] = t.item()

    # broadcast from an axis coordinate (not a global rank)
    t = torch.full((4,), 10.0 * rank)                           # 16 bytes
    out["bc_dp_same"] = comm.broadcast(t, mesh, "dp", src=1) is t
    out["bc_dp_src1"] = t.tolist()
    t = torch.full((5,), 10 * rank, dtype=torch.int64)          # 40 bytes
    comm.broadcast(t, mesh, "tp")
    out["bc_tp_src0"] = t.tolist()
    t = torch.full((1,), 10.0 * rank)                           # 4 bytes
    comm.broadcast(t, mesh, "tp", src=1)
    out["bc_tp_src1"] = t.item()

    # all_gather in the order of the axis coordinate, along dim
    out["ag_tp_dim0"] = comm.all_gather(torch.tensor([[rank, rank + 10]]), mesh, "tp").tolist()   # 16 bytes
    out["ag_dp_dim1"] = comm.all_gather(torch.tensor([[float(rank)]]), mesh, "dp", dim=1).tolist()  # 4 bytes
    nc = (torch.arange(6.0).view(2, 3) + 100 * rank).t()       # non-contiguous, 6 x fp32 = 24 bytes
    out["ag_dp_noncontig"] = comm.all_gather(nc, mesh, "dp", tag="nc").tolist()

    # async all_reduce: recorded when wait() returns
    t = torch.full((8,), float(rank))                           # 32 bytes
    n = len(mesh.log.records)
    pending = comm.all_reduce(t, mesh, "dp", async_op=True, tag="async")
    out["async_is_pending"] = isinstance(pending, Pending)
    out["async_recorded_before_wait"] = len(mesh.log.records) - n
    called = time.perf_counter()
    rec = pending.wait()
    out["async_value"] = t.tolist()
    out["async_rec_is_last"] = rec is mesh.log.records[-1]
    # the stamps a profile reads: wait() called, then completed, launched `seconds` before completing
    out["async_stamps"] = called <= rec.waited <= rec.end and rec.end - rec.seconds <= rec.waited

    out["records"] = _rows(mesh.log)
    out["wire_rows"] = [((r.op, r.bytes), r.wire) for r in mesh.log.records
                        if (r.op, r.bytes) in {("all_reduce", 12), ("broadcast", 40), ("all_gather", 16)}]
    out["seconds_ok"] = all(r.seconds >= 0 for r in mesh.log.records)

    # size-1 axes (pp, sp): no-op, same object, no record
    n = len(mesh.log.records)
    t = torch.ones(2)
    out["size1_same"] = [comm.all_reduce(t, mesh, "pp") is t, comm.broadcast(t, mesh, "sp") is t,
                         comm.all_gather(t, mesh, "pp") is t]
    p = comm.all_reduce(t, mesh, "sp", async_op=True)
    out["size1_async"] = (isinstance(p, Pending), p.wait())
    out["size1_values"] = t.tolist()
    out["size1_new_records"] = len(mesh.log.records) - n

    # tensor sub-axes on a second mesh over the same ranks (2D, tp=4, q=2)
    mesh2 = ck.ProcessMesh(ck.ParallelConfig(tp=4, tp_mode="2d"))
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t, mesh2, "tp_row")
    out["ar_tp_row"] = t.item()
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t, mesh2, "tp_col")
    out["ar_tp_col"] = t.item()
    out["ag_tp_row"] = comm.all_gather(torch.tensor([rank]), mesh2, "tp_row").tolist()
    t = torch.tensor([10 * rank])
    comm.broadcast(t, mesh2, "tp_col", src=1)
    out["bc_tp_col_src1"] = t.item()
    out["records2"] = _rows(mesh2.log)
    out["mesh1_untouched"] = len(mesh.log.records) == n

    # payload vs wire on a group of 4 (dp=4): 4 KiB each
    mesh4 = ck.ProcessMesh(ck.ParallelConfig(dp=4))
    comm.all_reduce(torch.ones(1024), mesh4, "dp")
    comm.all_gather(torch.ones(1024), mesh4, "dp")
    comm.reduce_scatter(torch.ones(1024), mesh4, "dp")
    comm.broadcast(torch.ones(1024), mesh4, "dp")
    comm.reduce(torch.ones(1024), mesh4, "dp")
    out["wire4"] = [(r.op, r.bytes, r.wire) for r in mesh4.log.records]
    out["one_shot"] = _one_shot_checks(mesh, mesh4, rank)
    return out


def _one_shot_checks(mesh, mesh4, rank):
    """comm.all_reduce's one-shot sum of a pair (``collectives.ONE_SHOT_BYTES``): per case, whether it went
    through the all-gather, its bits against gloo's own all_reduce of the same tensor, and its record."""
    from colab_kit.comm import collectives

    gathers = []
    real = collectives.torch_all_gather_single

    def counting(*args, **kwargs):
        gathers.append(1)
        return real(*args, **kwargs)
    collectives.torch_all_gather_single = counting
    gen = torch.Generator().manual_seed(rank)
    SUM, MAX, MIN = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN
    seen = []
    cases = {  # name: (tensor, mesh, axis, op, async, then)
        "64 KiB fp32": (torch.randn(16384, generator=gen), mesh, "tp", SUM, False, None),
        "64 KiB + 4 B": (torch.randn(16385, generator=gen), mesh, "tp", SUM, False, None),
        "bf16": (torch.randn(300, generator=gen).bfloat16(), mesh, "tp", SUM, False, None),
        "fp16": (torch.randn(300, generator=gen).half(), mesh, "dp", SUM, False, None),
        "int64": (torch.randint(-1000, 1000, (7,), generator=gen), mesh, "dp", SUM, False, None),
        "bool": (torch.rand(9, generator=gen) < 0.5, mesh, "tp", SUM, False, None),
        "non-contiguous": (torch.randn(6, 4, generator=gen).t(), mesh, "dp", SUM, False, None),
        "max": (torch.randn(50, generator=gen), mesh, "tp", MAX, False, None),
        "max as an object": (torch.randn(50, generator=gen), mesh, "tp", dist.ReduceOp(MAX), False, None),
        "min": (torch.randint(-9, 9, (50,), generator=gen), mesh, "dp", MIN, False, None),
        "requires grad": (torch.randn(40, generator=gen).requires_grad_().mul(1.0), mesh, "tp", SUM, False, None),
        "then": (torch.randn(40, generator=gen), mesh, "tp", SUM, False, lambda: seen.append(1)),
        "one element": (torch.randn(1, generator=gen), mesh, "tp", SUM, False, None),
        "product": (torch.randn(8, generator=gen), mesh, "tp", dist.ReduceOp.PRODUCT, False, None),
        "async": (torch.randn(64, generator=gen), mesh, "tp", SUM, True, None),
        "group of 4": (torch.randn(64, generator=gen), mesh4, "dp", SUM, False, None),
    }
    got = {}
    try:
        for name, (t, m, axis, op, is_async, then) in cases.items():
            want = t.detach().clone().contiguous()
            dist.all_reduce(want, op=op, group=m.group(axis))  # gloo's ring (or its one-element way)
            before, n = len(gathers), len(m.log.records)
            if then is not None:  # the caller's then runs once the result is in place
                then = (lambda tensor: lambda: seen.append(torch.equal(tensor, want)))(t)
            pending = comm.all_reduce(t, m, axis, op=op, async_op=is_async, tag=name, then=then)
            if is_async:
                pending.wait()
            rec = m.log.records[n]
            got[name] = (len(gathers) - before, torch.equal(t.detach(), want), (rec.op, rec.bytes, rec.wire),
                         t.contiguous().view(torch.uint8).tolist() if name == "64 KiB fp32" else None)
        got["then"] += (seen,)
        # the pipeline's path: with the hang flag armed the exchange is waited on through comm.finish
        import threading
        mesh.abort_flag = threading.Event()
        t = torch.randn(30, generator=gen)
        want = t.clone()
        dist.all_reduce(want, group=mesh.group("tp"))
        before = len(gathers)
        comm.all_reduce(t, mesh, "tp", tag="flag armed")
        got["flag armed"] = (len(gathers) - before, torch.equal(t, want), None, None)
        mesh.abort_flag = None
        collectives.ONE_SHOT_BYTES = 0  # off: the ring
        t = torch.randn(64, generator=gen)
        before = len(gathers)
        comm.all_reduce(t, mesh, "tp")
        got["switched off"] = (len(gathers) - before, None, None, None)
    finally:
        collectives.torch_all_gather_single = real
        collectives.ONE_SHOT_BYTES = 64 << 10
        mesh.abort_flag = None
    return got


@pytest.fixture(scope="module")
def results():
    return ck.launch(comm_checks, 4, timeout=120)


def by_rank(results, key):
    return [r[key] for r in results]


def test_all_reduce_values(results):
    assert by_rank(results, "ar_tp_same") == [True] * 4
    assert by_rank(results, "ar_tp") == [[3.0] * 3, [3.0] * 3, [7.0] * 3, [7.0] * 3]  # 1+2, 3+4
    assert by_rank(results, "ar_dp") == [[4.0] * 2, [6.0] * 2, [4.0] * 2, [6.0] * 2]  # 1+3, 2+4
    assert by_rank(results, "ar_tp_max") == [1.0, 1.0, 3.0, 3.0]


def test_broadcast_values(results):
    assert by_rank(results, "bc_dp_same") == [True] * 4
    # dp coordinate 1 of group [0, 2] is rank 2, of [1, 3] is rank 3
    assert by_rank(results, "bc_dp_src1") == [[20.0] * 4, [30.0] * 4, [20.0] * 4, [30.0] * 4]
    assert by_rank(results, "bc_tp_src0") == [[0] * 5, [0] * 5, [20] * 5, [20] * 5]
    assert by_rank(results, "bc_tp_src1") == [10.0, 10.0, 30.0, 30.0]


def test_all_gather_values(results):
    assert by_rank(results, "ag_tp_dim0") == [[[0, 10], [1, 11]]] * 2 + [[[2, 12], [3, 13]]] * 2
    assert by_rank(results, "ag_dp_dim1") == [[[0.0, 2.0]], [[1.0, 3.0]], [[0.0, 2.0]], [[1.0, 3.0]]]
    block = lambda r: (torch.arange(6.0).view(2, 3) + 100 * r).t().tolist()  # noqa: E731
    for r, got in enumerate(by_rank(results, "ag_dp_noncontig")):
        dp_group = [0, 2] if r % 2 == 0 else [1, 3]
        assert got == block(dp_group[0]) + block(dp_group[1])


def test_async_all_reduce(results):
    assert by_rank(results, "async_is_pending") == [True] * 4
    assert by_rank(results, "async_recorded_before_wait") == [0] * 4
    assert by_rank(results, "async_value") == [[2.0] * 8, [4.0] * 8, [2.0] * 8, [4.0] * 8]
    assert by_rank(results, "async_rec_is_last") == [True] * 4
    assert by_rank(results, "async_stamps") == [True] * 4


def test_every_call_is_recorded_with_op_axis_bytes(results):
    expected = [
        ("all_reduce", "tp", 12, ""),
        ("all_reduce", "dp", 16, "grads"),
        ("all_reduce", "tp", 4, ""),
        ("broadcast", "dp", 16, ""),
        ("broadcast", "tp", 40, ""),
        ("broadcast", "tp", 4, ""),
        ("all_gather", "tp", 16, ""),
        ("all_gather", "dp", 4, ""),
        ("all_gather", "dp", 24, "nc"),
        ("all_reduce", "dp", 32, "async"),
    ]
    for r in results:
        assert r["records"] == expected
        assert r["seconds_ok"]


def test_payload_and_wire_bytes_under_the_ring_model(results):
    """payload = what the rank handed in; wire = what it sends: all_reduce 2(n-1)/n S, all_gather
    (n-1) s, reduce_scatter / broadcast / reduce (n-1)/n S, for n = 4 and S = s = 4096."""
    for r in results:
        assert r["wire4"] == [("all_reduce", 4096, 6144), ("all_gather", 4096, 12288),
                              ("reduce_scatter", 4096, 3072), ("broadcast", 4096, 3072), ("reduce", 4096, 3072)]
    # on the groups of 2 above: all_reduce 2 * 1/2 S = S, all_gather s, broadcast S/2
    wire = {rec[0]: rec[1] for rec in results[0]["wire_rows"]}
    assert wire == {("all_reduce", 12): 12, ("broadcast", 40): 20, ("all_gather", 16): 16}


def test_size_one_axis_is_a_no_op(results):
    for r in results:
        assert r["size1_same"] == [True, True, True]
        assert r["size1_async"] == (True, None)
        assert r["size1_values"] == [1.0, 1.0]
        assert r["size1_new_records"] == 0


def test_tensor_sub_axes(results):
    assert by_rank(results, "ar_tp_row") == [4.0, 6.0, 4.0, 6.0]   # tp_row groups [0,2], [1,3]
    assert by_rank(results, "ar_tp_col") == [3.0, 3.0, 7.0, 7.0]   # tp_col groups [0,1], [2,3]
    assert by_rank(results, "ag_tp_row") == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert by_rank(results, "bc_tp_col_src1") == [10, 10, 30, 30]
    for r in results:
        assert r["records2"] == [("all_reduce", "tp_row", 4, ""), ("all_reduce", "tp_col", 4, ""),
                                 ("all_gather", "tp_row", 8, ""), ("broadcast", "tp_col", 8, "")]
        assert r["mesh1_untouched"]  # each mesh has its own log


def test_a_pairs_small_sum_is_one_exchange_with_the_rings_bits(results):
    """comm.all_reduce on a pair of CPU ranks sums (maxes, mins) 2 or more elements up to 64 KiB one-shot (an
    all-gather and an add, one round where gloo's ring takes two): the same bits as gloo's all_reduce of the
    same tensor in every dtype here, both ranks of the pair alike, recorded as an all_reduce with the ring's
    payload and wire (S each way on 2 ranks), a tensor that requires grad too, the caller's then after the
    sum, the hang flag's wait path too; one byte more, one element, a product, an async call, a group of 4
    or ONE_SHOT_BYTES = 0 keep the ring."""
    one_shot = {"64 KiB fp32": 65536, "bf16": 600, "fp16": 600, "int64": 56, "bool": 9, "non-contiguous": 96,
                "max": 200, "max as an object": 200, "min": 400, "requires grad": 160, "then": 160}
    ring = {"64 KiB + 4 B": 65540, "one element": 4, "product": 32, "async": 256}
    for r in results:
        got = r["one_shot"]
        for name, nbytes in one_shot.items():
            assert got[name][:3] == (1, True, ("all_reduce", nbytes, nbytes)), (name, got[name])
        for name, nbytes in ring.items():
            assert got[name][:3] == (0, True, ("all_reduce", nbytes, nbytes)), (name, got[name])
        assert got["group of 4"][:3] == (0, True, ("all_reduce", 256, 384))
        assert got["then"][4] == [True]  # the caller's then ran once, after the sum was in place
        assert got["flag armed"][:2] == (1, True)
        assert got["switched off"][0] == 0
    pairs = [(0, 1), (2, 3)]  # tp groups: the same bits on both ranks of a pair, other bits on the other pair
    bits = [r["one_shot"]["64 KiB fp32"][3] for r in results]
    assert all(bits[a] == bits[b] for a, b in pairs) and bits[0] != bits[2]
