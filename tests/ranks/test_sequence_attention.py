"""The attention kernels of sequence parallelism (``colab_kit.sequence``) against dense causal attention.

Tier 1, one process: the zigzag and contiguous splits put back together, the positions of each
rank's tokens, the uneven-length and bad-head-count refusals (with the multiple / sp to use),
the log-sum-exp merge, and the ring at sp=1.

Tier 2, one ``ck.launch`` per world size (2, 3, 4), cases looped inside: ring (zigzag and
contiguous) and Ulysses (contiguous and zigzag) give the outputs and the Q/K/V gradients of
``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on the whole sequence in one process
(float64 and float32, within 1e-5); the ring's recorded rotations (sp - 1 K/V sends per forward,
which chunks each rank holds at each rotation, the next transfer posted before the compute); no
op of the ring makes a tensor larger than ``t_local x t_local`` per head (a dispatch-mode probe
of every op's output); the zigzag gives every rank the same FLOPs (FlopCounterMode); Ulysses
runs two all-to-alls each way and refuses sp=3 with 4 heads before any collective.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import colab_kit as ck
from colab_kit import comm
from colab_kit.comm import CommLog
from colab_kit.observe.throughput import flop_counter
from colab_kit.sequence import (RingRecorder, check_heads, chunk_ids, gathered_order, merge_lse, ring_attention,
                                sequence_positions, split_sequence, ulysses_attention, unsplit_sequence)

B, H, T, D = 2, 4, 48, 8          # t_local = 24, 16, 12 at sp = 2, 3, 4: always >= D
TOL = 1e-5
WORLDS = {  # sp -> (mode, layout, dtype) cases, run inside one spawn
    2: [("ring", "zigzag", torch.float64), ("ring", "zigzag", torch.float32), ("ring", "contiguous", torch.float64),
        ("ulysses", "contiguous", torch.float64), ("ulysses", "zigzag", torch.float64)],
    3: [("ring", "zigzag", torch.float64), ("ring", "zigzag", torch.float32)],
    4: [("ring", "zigzag", torch.float64), ("ulysses", "contiguous", torch.float64),
        ("ulysses", "zigzag", torch.float32)],
}


def _inputs(dtype=torch.float64, dv=D):
    """q, k, v and the upstream gradient of the whole sequence, the same on every rank (``dv``: the value
    heads' width, DeepSeek's multi-head latent attention has its own)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randn(B, H, T, d, generator=g, dtype=torch.float64).to(dtype) for d in (D, D, dv, dv)]


DV = 5  # the value heads' width in the unequal-widths cases (sp=2), against D = 8 for queries and keys


class OneRank:
    """A stand-in mesh of one rank on every axis (no processes): the kernels' sp=1 case."""
    log = CommLog()

    def size(self, axis):
        return 1

    def rank(self, axis):
        return 0


class LargestOutput(TorchDispatchMode):
    """The largest ``size(-2) * size(-1)`` of any op's output while on: a score block shows up here."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                self.largest = max(self.largest, t.shape[-2] * t.shape[-1])
        return out


# --------------------------------------------------------------------------- tier 1
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_split_and_unsplit_round_trip_and_positions(layout):
    for sp, t in ((1, 6), (2, 8), (3, 12), (4, 48)):
        x = torch.randn(2, t, 3)
        pieces = [split_sequence(x, r, sp, layout=layout) for r in range(sp)]
        assert all(p.shape == (2, t // sp, 3) for p in pieces)
        assert torch.equal(unsplit_sequence(pieces, layout=layout), x)
        y = torch.randn(2, 3, t, 5)  # [b, heads, t, d]: the sequence along dim 2
        assert torch.equal(unsplit_sequence([split_sequence(y, r, sp, dim=2, layout=layout) for r in range(sp)],
                                            dim=2, layout=layout), y)
        pos = [sequence_positions(r, sp, t, layout) for r in range(sp)]
        assert all(torch.equal(split_sequence(torch.arange(t).view(1, t), r, sp, layout=layout)[0], pos[r])
                   for r in range(sp))
        assert torch.equal(torch.cat(pos), gathered_order(sp, t, layout))
        assert torch.equal(unsplit_sequence([p.view(1, -1) for p in pos], layout=layout)[0], torch.arange(t))


def test_zigzag_chunks_and_causal_work_are_balanced():
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [chunk_ids(r, 4, "contiguous") for r in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    for sp in (2, 3, 4, 8):
        # causal work of a rank = number of (query, key) pairs with key <= query over its positions
        t = 2 * sp * 4
        work = {int((sequence_positions(r, sp, t) + 1).sum()) for r in range(sp)}
        assert len(work) == 1, (sp, work)


def test_an_uneven_sequence_is_refused_with_the_multiple_to_use():
    with pytest.raises(ck.ConfigError, match=r"50 tokens does not split over sp=2.*multiple of 4 \(48 or 52\)"):
        split_sequence(torch.zeros(1, 50), 0, 2)
    with pytest.raises(ValueError, match=r"multiple of 6 \(6 or 12\)"):
        sequence_positions(0, 3, 10)
    q = torch.zeros(1, 1, 3, 4)
    with pytest.raises(ValueError, match=r"multiple of 2\*sp = 2"):
        ring_attention(q, q, q, OneRank())


def test_ulysses_refuses_heads_that_sp_does_not_divide():
    class Three(OneRank):
        def size(self, axis):
            return 3

    check_heads(6, 3)  # 6 heads: sp=3 is fine
    q5 = torch.zeros(1, 5, 4, 2)
    with pytest.raises(ck.ConfigError, match=r"sp must divide the 5 heads \(sp=3 does not\): use sp in \[1, 5\]"):
        ulysses_attention(q5, q5, q5, Three())


def test_merge_lse_is_the_softmax_over_the_union():
    s, v = torch.randn(2, 5, 9, dtype=torch.float64), torch.randn(2, 9, 3, dtype=torch.float64)
    parts = [(torch.softmax(s[..., sl], -1) @ v[:, sl], s[..., sl].logsumexp(-1))
             for sl in (slice(0, 2), slice(2, 7), slice(7, 9))]
    o, lse = None, None
    for o_b, l_b in parts:
        o, lse = merge_lse(o, lse, o_b, l_b)
    torch.testing.assert_close(o, torch.softmax(s, -1) @ v, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, s.logsumexp(-1), rtol=0, atol=1e-12)


def test_ring_and_ulysses_at_sp_1_are_dense_attention():
    q, k, v, do = _inputs()
    for fn in (ring_attention, ulysses_attention):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves, OneRank())
        (out * do).sum().backward()
        ref = _dense()
        for got, want in zip([out.detach()] + [x.grad for x in leaves], ref):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- tier 2: on each rank
def _one_case(mesh, mode, layout, dtype, dv=D):
    n, r = mesh.size("sp"), mesh.rank("sp")
    q, k, v, do = _inputs(dtype, dv)
    leaves = [split_sequence(x, r, n, dim=2, layout=layout).requires_grad_() for x in (q, k, v)]
    rec, probe, start = RingRecorder(), LargestOutput(), len(mesh.log.records)
    with flop_counter() as flops, probe:  # FlopCounterMode that counts the CPU flash kernel the ring runs
        if mode == "ring":
            out = ring_attention(*leaves, mesh, layout=layout, recorder=rec)
        else:
            out = ulysses_attention(*leaves, mesh, layout=layout)
    fwd_flops, mid = flops.get_total_flops(), len(mesh.log.records)
    with probe:
        (out * split_sequence(do, r, n, dim=2, layout=layout)).sum().backward()
    rows = lambda a, b: [(x.op, x.tag, x.bytes) for x in mesh.log.records[a:b]]  # noqa: E731
    return dict(out=out.detach(), grads=[x.grad for x in leaves], events=rec.events, largest=probe.largest,
                flops=fwd_flops, fwd_comm=rows(start, mid), bwd_comm=rows(mid, None))


def _on_rank(n, cases):
    results, meshes = {}, {}
    for mode, layout, dtype in cases:
        if mode not in meshes:  # ParallelConfig takes sp with either mode
            meshes[mode] = ck.ProcessMesh(ck.ParallelConfig(sp=n, sp_mode=mode))
        results[mode, layout, str(dtype)] = _one_case(meshes[mode], mode, layout, dtype)
    if n == 2:  # value heads of another width than query and key heads (MLA), both modes
        for mode, layout in (("ring", "zigzag"), ("ulysses", "contiguous")):
            results["mla", mode] = _one_case(meshes[mode], mode, layout, torch.float64, dv=DV)
        # bf16: the ring's blocks run in the compute dtype (the fused kernel), its K/V messages bf16 too
        results["bf16"] = _one_case(meshes["ring"], "ring", "zigzag", torch.bfloat16)
    mesh = next(iter(meshes.values()))
    if n == 3:  # 4 heads over sp=3: refused before any collective, on every rank
        q = torch.zeros(1, H, 4, D)
        try:
            ulysses_attention(q, q, q, mesh)
        except ck.ConfigError as exc:
            results["refused"] = str(exc)
    if n == 4:  # the plain recorded all-to-all: x[j] holds 10 * rank + j
        x = (10 * mesh.rank("sp") + torch.arange(4.0)).view(4, 1).repeat(1, 2)
        results["all_to_all"] = comm.all_to_all(x, mesh, "sp", split_dim=0, cat_dim=1, tag="probe")
        rec = mesh.log.records[-1]
        results["a2a_record"] = (rec.op, rec.axis, rec.tag, rec.bytes, rec.wire)
    return results


@pytest.fixture(scope="module")
def dense():
    return {torch.float64: _dense()}


def _dense(dv=D):
    """Output and q, k, v gradients of causal SDPA on the whole sequence, in one process (float64)."""
    q, k, v, do = _inputs(dv=dv)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True)
    (out * do).sum().backward()
    return [out.detach()] + [x.grad for x in leaves]


def _check_parity(results, n, dense_ref) -> dict:
    errors = {}
    for mode, layout, dtype in WORLDS[n]:
        key = (mode, layout, str(dtype))
        got = [res[key] for res in results]
        whole = [unsplit_sequence([g["out"] for g in got], dim=2, layout=layout)]
        whole += [unsplit_sequence([g["grads"][i] for g in got], dim=2, layout=layout) for i in range(3)]
        for name, w, ref in zip(("out", "dq", "dk", "dv"), whole, dense_ref[torch.float64]):
            assert w.dtype == dtype
            err = (w.double() - ref).abs().max().item()
            errors[key + (name,)] = err
            assert err < TOL, (n, key, name, err)
    return errors


def _check_ring(results, n, layout="zigzag", dtype=torch.float64):
    key = ("ring", layout, str(dtype))
    t_local, c = T // n, T // (2 * n)
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * B * H * t_local * D * itemsize
    for r, res in enumerate(results):
        got = res[key]
        fwd = [e for e in got["events"] if e["phase"] == "forward"]
        bwd = [e for e in got["events"] if e["phase"] == "backward"]
        for events in (fwd, bwd):
            assert [e["rotation"] for e in events] == list(range(n)) and {e["rank"] for e in events} == {r}
            assert [e["holds"] for e in events] == [list(chunk_ids((r - i) % n, n, layout)) for i in range(n)]
            for e in events[:-1]:  # the next K/V was on its way before this rotation's blocks ran
                assert e["posted"] is not None and e["posted"] <= e["start"] <= e["end"]
            assert events[-1]["posted"] is None
        # sp - 1 rotations forward: one K/V message each way per rotation
        assert got["fwd_comm"] == [("send", "ring kv", kv_bytes), ("recv", "ring kv", kv_bytes)] * (n - 1)
        bwd_tags = [(op, tag) for op, tag, _ in got["bwd_comm"]]
        assert bwd_tags.count(("send", "ring kv backward")) == n - 1
        assert bwd_tags.count(("send", "ring dkv")) == bwd_tags.count(("recv", "ring dkv")) == n
        # never a score block beyond t_local x t_local per head (the chunks' blocks are c x c)
        assert got["largest"] <= t_local * t_local < T * T, (r, got["largest"])
    for i in range(n):  # at every rotation the ranks hold every K/V chunk exactly once
        held = sorted(ch for res in results for e in res[key]["events"]
                      if e["phase"] == "forward" and e["rotation"] == i for ch in e["holds"])
        assert held == list(range(2 * n))
    flops = [res[key]["flops"] for res in results]
    if layout == "zigzag":  # every rank: own K/V 3 blocks, each other rank's 2; 2 matmuls of c x c x D each
        assert flops == [(2 * n + 1) * 2 * 2 * B * H * c * c * D] * n, flops


def _check_ulysses(results, n, layout, dtype):
    key = ("ulysses", layout, str(dtype))
    itemsize = torch.empty((), dtype=dtype).element_size()
    local = B * H * (T // n) * D * itemsize
    for res in results:
        got = res[key]
        assert got["fwd_comm"] == [("all_to_all", "ulysses", 3 * local), ("all_to_all", "ulysses", local)]
        assert [(op, tag) for op, tag, _ in got["bwd_comm"]] == [("all_to_all", "ulysses backward")] * 2


def _run_world(n, dense_ref):
    results = ck.launch(_on_rank, n, n, WORLDS[n], timeout=300)
    errors = _check_parity(results, n, dense_ref)
    for mode, layout, dtype in WORLDS[n]:
        if mode == "ring":
            _check_ring(results, n, layout, dtype)
        else:
            _check_ulysses(results, n, layout, dtype)
    print(f"sp={n} max abs errors:", {"/".join(map(str, k)): f"{v:.1e}" for k, v in errors.items()})
    return results


def test_sp2_ring_and_ulysses_equal_dense_attention(dense):
    results = _run_world(2, dense)
    # bf16 in, bf16 out, K/V rotating as bf16 (half fp32's bytes), within bf16's precision of the fp64 reference
    got = [res["bf16"] for res in results]
    out = unsplit_sequence([g["out"] for g in got], dim=2, layout="zigzag")
    assert out.dtype == torch.bfloat16 and (out.double() - dense[torch.float64][0]).abs().max().item() < 3e-2
    assert got[0]["fwd_comm"][0] == ("send", "ring kv", 2 * B * H * (T // 2) * D * 2)
    ref = _dense(dv=DV)  # value heads 5 wide, query and key heads 8 (MLA's shape: d_qk != d_v)
    assert ref[0].shape[-1] == DV and ref[3].shape[-1] == DV
    for mode, layout in (("ring", "zigzag"), ("ulysses", "contiguous")):
        got = [res["mla", mode] for res in results]
        whole = [unsplit_sequence([g["out"] for g in got], dim=2, layout=layout)]
        whole += [unsplit_sequence([g["grads"][i] for g in got], dim=2, layout=layout) for i in range(3)]
        for name, w, want in zip(("out", "dq", "dk", "dv"), whole, ref):
            assert w.shape == want.shape and (w - want).abs().max().item() < TOL, (mode, name)


def test_sp3_ring_equals_dense_attention_and_ulysses_refuses_4_heads(dense):
    results = _run_world(3, dense)
    assert all("sp must divide the 4 heads (sp=3 does not): use sp in [1, 2, 4]" in res["refused"]
               for res in results)


def test_sp4_ring_and_ulysses_equal_dense_attention_and_all_to_all(dense):
    results = _run_world(4, dense)
    for r, res in enumerate(results):  # block r of every rank j, concatenated along dim 1 in rank order
        want = torch.tensor([[10.0 * j + r for j in range(4) for _ in range(2)]])
        assert torch.equal(res["all_to_all"], want), (r, res["all_to_all"])
        assert res["a2a_record"] == ("all_to_all", "sp", "probe", 32, 24)  # keeps 1/4 of its 32 bytes
