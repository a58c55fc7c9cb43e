"""Several ranks on one GPU (``comm/rules/staging.py``), played on CPU ranks: ``COLAB_KIT_RULES_STAGE=1`` runs every
collective and message of an ``nccl_rules`` group on host copies of the caller's tensors and copies the outputs
back when the Work completes, as a job with ``COLAB_KIT_RULES_DEVICE=cuda`` does with CUDA tensors.

One spawn of 4 ranks loops compositions that between them make every kind of call: all-reduce (tp, dp), the
all-gather and reduce-scatter of ZeRO-3, Ulysses's all-to-all, expert parallelism's all-to-all of uneven splits,
the pipeline's batched sends and receives (1F1B, ZB-V), ring attention's, 2D's broadcasts (whose root keeps
the tensor autograd saved), offload. Each trains
to one process's losses (fp32, 1e-5), and each rank saw its groups stage. A call whose outputs were not copied
back (``Staged``'s copy skipped) leaves the caller's tensors as they were: the same program then fails at its
first step (the engine's check that every rank was handed the same batch reads an all-gather that never landed).
"""
from __future__ import annotations

import pytest
import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.engine.reference import max_relative_difference, train_single_process
from colab_kit.models import GPT
from tests.helpers import moe
from tests.helpers.matrix import BATCH, CFG, PP, RTOL, STEPS

DENSE = {
    "dp=2 tp=2": dict(dp=2, tp=2),
    "ulysses x dp x zero=3": dict(dp=2, sp=2, sp_mode="ulysses", zero=3),
    "ring x pp 1f1b": dict(sp=2, **PP, schedule="1f1b"),
    "zero=2 x zb-v": dict(dp=2, **PP, schedule="zb-v", chunks=2, zero=2),
    "2d": dict(tp=4, tp_mode="2d"),  # a broadcast root's saved activation: its copy-back must not bump its version
    "ulysses x dp x zero=3 offload": dict(dp=2, sp=2, sp_mode="ulysses", zero=3, offload="cpu"),
}
EXPERTS = ("dp=4 ep=2", dict(dp=4, ep=2))
OPT = lambda ps: torch.optim.AdamW(ps, lr=3e-3)  # noqa: E731


def _run(skip_copy_back: bool) -> dict:
    import torch.distributed as dist

    from colab_kit.comm.rules import staging

    if skip_copy_back:  # what a group that forgot its outputs would compute
        staging.Staged._copy_back = lambda self: None
    out = {"staging": dist.distributed_c10d._get_default_group().staging}
    for name, kw in (list(DENSE.items())[:1] if skip_copy_back else DENSE.items()):
        engine = ck.boost(GPT(CFG), OPT, ck.ParallelConfig(**kw))
        data = SyntheticTokens(CFG.vocab_size, CFG.seq_len, seed=3)
        out[name] = [engine.train_step(data.batch(s, BATCH)) for s in range(STEPS)]
        engine.close()
    if not skip_copy_back:
        name, kw = EXPERTS
        engine = ck.boost(moe.build("capacity"), moe.OPTIMIZERS["adamw"], ck.ParallelConfig(**kw))
        out[name] = [engine.train_step(moe.data().batch(s, moe.BATCH)) for s in range(moe.STEPS)]
        engine.close()
    return out


@pytest.fixture(scope="module")
def runs():
    mp = pytest.MonkeyPatch()
    mp.setenv("COLAB_KIT_RULES_STAGE", "1")  # handed to the ranks by ck.launch (launch.RULES_ENV)
    try:
        return ck.launch(_run, 4, False, timeout=600)
    finally:
        mp.undo()  # the other tests of the session launch plain ranks


def _reference() -> list[float]:
    return train_single_process(CFG, OPT, SyntheticTokens(CFG.vocab_size, CFG.seq_len, seed=3), STEPS, BATCH)[0]


@pytest.mark.parametrize("name", list(DENSE))
def test_a_staged_composition_trains_like_one_process(runs, name):
    staged = runs
    want = _reference()
    for rank, got in enumerate(staged):
        assert got["staging"], f"rank {rank}'s groups did not stage"
        assert max_relative_difference(got[name], want) <= RTOL, (name, rank, got[name], want)


def test_staged_expert_parallelism_trains_like_one_process(runs):
    staged = runs
    want = moe.reference("capacity", "adamw", dp=4)
    for rank, got in enumerate(staged):
        assert max_relative_difference(got[EXPERTS[0]], want) <= RTOL, (rank, got[EXPERTS[0]], want)


def test_outputs_left_on_the_host_fail(monkeypatch):
    monkeypatch.setenv("COLAB_KIT_RULES_STAGE", "1")
    # the batch check's all-gather lands nothing: what its output held before (a receive-only buffer is not even
    # copied to the host) reads as another batch, or as no batch at all; either way the first step is refused
    with pytest.raises(ck.RankError, match="were handed a different batch|passed no pair of tensors"):
        ck.launch(_run, 4, True, timeout=300)


def _dtensor_calls():
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    whole = distribute_tensor(torch.arange(8.0).view(4, 2), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    summed = funcol.all_reduce(torch.ones(3) * (dist.get_rank() + 1), "sum", mesh)
    gathered = funcol.all_gather_tensor(torch.full((2,), float(dist.get_rank())), 0, mesh)
    return whole.to_local().tolist(), summed.tolist(), gathered.tolist()


def test_dtensor_and_functional_collectives_get_their_outputs(monkeypatch):
    """torch's functional collectives (what DTensor's redistribute runs) hand the group an output they wait on
    with ``wait_tensor``: the staged Work's wait puts the result there."""
    monkeypatch.setenv("COLAB_KIT_RULES_STAGE", "1")
    want = ([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]], [3.0, 3.0, 3.0], [0.0, 0.0, 1.0, 1.0])
    assert ck.launch(_dtensor_calls, 2) == [want, want]


def _reduce_to_0():
    import torch.distributed as dist

    x = torch.full((4,), float(dist.get_rank() + 1))
    dist.reduce(x, dst=0)
    return x.tolist()


def test_a_staged_reduce_leaves_the_other_ranks_tensors_as_nccl_does(monkeypatch):
    """gloo's ring reduce leaves partial sums in the non-root ranks' buffers; NCCL leaves them as they were, and
    so does a staged group (only the root's output is copied back)."""
    monkeypatch.setenv("COLAB_KIT_RULES_STAGE", "1")
    assert ck.launch(_reduce_to_0, 3) == [[6.0] * 4, [2.0] * 4, [3.0] * 4]


def test_plain_ranks_do_not_stage():
    def staging():
        import torch.distributed as dist
        return dist.distributed_c10d._get_default_group().staging

    assert ck.launch(staging, 2) == [False, False]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_object_collectives_put_their_bytes_on_the_groups_device(device):
    """torch's object collectives (``all_gather_object``, ``broadcast_object_list``: checkpoints, ``engine.fit``)
    put their bytes on the device a group reports, as NCCL's group reports ``[cuda]``. A rules group is a Python
    group with no backend registered, so torch read ``[]`` and picked the CPU: on ranks sharing a GPU
    (``COLAB_KIT_RULES_DEVICE=cuda``) the device rule then refused them and every checkpoint failed. One process,
    a group of one rank (no CUDA needed: only the device torch picks is asked)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_object_coll_device

    from colab_kit.comm.rules.group import RulesGroup

    group = RulesGroup(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10), None, device, name="objects")
    try:
        assert _get_object_coll_device(group) == device
    finally:
        group.shutdown()
