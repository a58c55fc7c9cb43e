"""Reading CUDA's allocator log as a step's memory timeline (``colab_kit.memory.history``), on a log built
here in the shape ``torch.cuda.memory._snapshot()`` gives (its ``device_traces`` entries and ``segments``
blocks). Recording the log needs a GPU: ``bench/gpu_check.py``'s ``memory_history`` check does that."""
import pytest

from colab_kit.memory.history import HistoryError, _blocks, frames_machinery, history_series

SITE = "/venv/lib/python3.11/site-packages"
MODEL = [{"filename": "/work/colab_kit/models/gpt.py", "line": 88, "name": "forward"}]
TORCH_NN = [{"filename": f"{SITE}/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}]
BUCKET = [{"filename": f"{SITE}/torch/nn/functional.py", "line": 5, "name": "pad"},
          {"filename": f"{SITE}/colab_kit/zero/stage0.py", "line": 190, "name": "_flush"}]
ADAM = [{"filename": f"{SITE}/torch/optim/adam.py", "line": 400, "name": "_single_tensor_adam"},
        {"filename": f"{SITE}/colab_kit/zero/stage1.py", "line": 50, "name": "step"}]


def alloc(addr, size, frames=MODEL, t=None):
    e = {"action": "alloc", "addr": addr, "size": size, "stream": 0, "frames": frames}
    return e if t is None else {**e, "time_us": t}


def free(addr, size, t=None):
    e = {"action": "free_requested", "addr": addr, "size": size, "stream": 0, "frames": []}
    return e if t is None else {**e, "time_us": t}


def recording(clock=True, base=1_000_000):
    """A step's log, in requested bytes: params, grads, optimizer states, the batch and a 4-byte scalar held
    before; then an activation (saved), a bucket (machinery), a temporary freed and its address reused by
    a saved tensor, an optimizer temporary freed and its address reused by a gradient the step keeps (the
    walk finds it there after the step: only the kept block is a gradient), the loss (4 bytes: its block is
    512, the log says 4); the log goes on after the step (its last entries are not the step's)."""
    t = (lambda us: base + us) if clock else (lambda us: None)
    step = [alloc(0x5000, 4096, TORCH_NN + MODEL, t(10)),     # n0: saved for backward
            alloc(0x6000, 8192, BUCKET, t(20)),               # n1: a bucket (colab_kit.zero)
            alloc(0x7000, 512, t=t(30)),                      # n2: a temporary
            free(0x7000, 512, t(40)),
            alloc(0x7000, 1024, t=t(50)),                     # n3: same address, saved
            {"action": "segment_alloc", "addr": 0xA000, "size": 1 << 21, "stream": 0, "frames": []},
            free(0x4000, 512, t(60)),                         # the batch from before the step
            free(0x5000, 4096, t(70)),
            alloc(0x8000, 2048, ADAM, t(80)),                 # n4: torch.optim stops the search: temporary
            free(0x8000, 2048, t(90)),
            free(0x6000, 8192, t(100)),
            alloc(0x8000, 2048, ADAM, t(110)),                # n5: at the same address, a gradient kept
            alloc(0xB000, 4, t=t(120))]                       # n6: the loss
    after = [alloc(0x9000, 512, t=t(300)), free(0x9000, 512, t(310))]
    start = [(0x1000, 1024, []), (0x2000, 1024, []), (0x3000, 2048, []), (0x4000, 512, MODEL), (0xC000, 4, [])]
    return {"trace": step + after, "start_blocks": start,
            "owners0": {0x1000: "params", 0x2000: "grads", 0x3000: "optimizer"},
            "owners1": {0x1000: "params", 0x2000: "grads", 0x3000: "optimizer", 0x8000: "grads"},
            "saved": [(101, 0x5000), (104, 0x7000), (104, 0x1000)],  # (allocations counted so far, address)
            "count0": 100, "count1": 107, "count2": 108, "freed0": 7, "freed1": 12, "freed2": 13,
            "t0_ns": 1_000_000_000, "wall": 0.0002}


def test_the_log_gives_each_block_its_category_and_the_allocators_totals():
    got = history_series(recording())
    s, totals = got["series"], got["totals"]
    assert len(got["times"]) == len(got["ops"]) == len(totals) == 1 + 12  # the start, then the step's entries
    assert {c: v[0] for c, v in s.items()} == {"params": 1024, "grads": 1024, "optimizer": 2048,
                                               "activations": 0, "in_flight": 0, "temporaries": 516}
    assert [s["activations"][i] for i in (1, 5, 8)] == [4096, 4096 + 1024, 1024]
    assert s["in_flight"][2] == 8192 and s["in_flight"][-1] == 0
    assert s["temporaries"][3] == 1028 and s["temporaries"][4] == 516  # the freed temporary, then its address reused
    assert s["temporaries"][8] == max(s["temporaries"]) == 2052  # the optimizer's temporary (after the batch went)
    assert s["grads"][8] == 1024 and s["grads"][-1] == 1024 + 2048  # its address held a gradient at the end
    assert s["temporaries"][-1] == 4 + 4  # the scalars, in requested bytes (their blocks are 512 each)
    assert totals == [sum(v[i] for v in s.values()) for i in range(len(totals))]
    assert totals[-1] == 4612 - 512 + 1024 + 2048 + 4 == 7176  # what the step ends with; the log's later entries left out
    assert max(totals) == totals[got["peak_index"]] == 4612 + 4096 + 8192 + 1024 == 17924
    assert got["peak_index"] == 5 and got["times"][1] == pytest.approx(10e-6) and got["times"] == sorted(got["times"])
    assert got["ops"][2].startswith("alloc 8,192 B stage0.py:190")
    top = got["alive_at_peak"]
    assert [r["nbytes"] for r in top[:2]] == [8192, 4096] and top[0]["category"] == "in_flight"
    assert sum(r["nbytes"] for r in top) == max(totals) and len(top) == 8  # every block alive there


def test_a_wrong_reading_is_caught():
    rec = recording()
    rec["saved"] = [(103, 0x7000)]  # saved before the address was reused: the first block there
    s = history_series(rec)["series"]
    assert s["activations"][3] == 512 and s["activations"][5] == 0  # so the second one is a temporary
    lost = recording()
    lost["trace"] = lost["trace"][1:]  # the log's ring lost its oldest entry, the step's first allocation
    with pytest.raises(HistoryError, match="kept 7 of the 8 allocations"):
        history_series(lost)
    crowded = recording()
    crowded["trace"] = crowded["trace"] + [alloc(0xD000, 512)]  # an allocation the counters never saw
    with pytest.raises(HistoryError, match="another thread used the allocator"):
        history_series(crowded)


def test_without_a_clock_the_samples_spread_over_the_step():
    got = history_series(recording(clock=False))
    assert got["times"][0] == 0.0 and got["times"][-1] == pytest.approx(0.0002)
    assert got["times"] == sorted(got["times"])
    other = history_series(recording(base=5_000))  # a clock that is not Unix time: the log's own spacing
    assert other["times"][1] == 0.0 and other["times"][-1] == pytest.approx(110e-6)  # its step's entries span 110 us
    assert history_series(recording())["times"][-1] == pytest.approx(120e-6)  # Unix time: since the step began


def test_machinery_is_judged_from_the_nearest_frame_outside_torch():
    assert frames_machinery(BUCKET)
    assert not frames_machinery(ADAM)  # the optimizer's temporaries are not machinery
    assert not frames_machinery(TORCH_NN + MODEL)
    assert frames_machinery([{"filename": f"{SITE}/torch/distributed/fsdp/_fully_shard/_fsdp_param.py"}])
    assert not frames_machinery([])
    venv = "/home/u/colab_kit/.venv/lib/python3.11/site-packages"  # a checkout named colab_kit, torch inside it
    assert not frames_machinery([{"filename": f"{venv}/torch/optim/adam.py"}, BUCKET[1]])
    assert frames_machinery([{"filename": f"{venv}/torch/nn/functional.py"}, BUCKET[1]])


def test_the_start_is_read_in_requested_bytes_from_the_snapshots_blocks():
    snap = {"segments": [
        {"device": 0, "blocks": [{"address": 0x10, "size": 512, "requested_size": 4, "state": "active_allocated"},
                                 {"address": 0x210, "size": 1536, "requested_size": 1500, "state": "inactive"}]},
        {"device": 1, "blocks": [{"address": 0x99, "size": 512, "requested_size": 8, "state": "active_allocated"}]},
        {"device": 0, "blocks": [{"address": 0x800, "size": 2 << 20, "requested_size": (2 << 20) - 300_000,
                                  "state": "active_allocated", "frames": MODEL}]}]}
    assert _blocks(snap, 0) == [(0x10, 4, []), (0x800, (2 << 20) - 300_000, MODEL)]  # device 0's, allocated
