"""Reading CUDA's allocator log as a step's memory timeline (``colab_kit.memory.history``), on a log built
here in the shape ``torch.cuda.memory._snapshot()`` gives (its ``device_traces`` entries and ``segments``
blocks). Recording the log needs a GPU: ``bench/gpu_check.py``'s ``memory_history`` check does that."""
import pytest

from colab_kit.memory.history import HistoryError, frames_machinery, history_series

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
    """A step's log: params, grads, optimizer states and the batch held before; then an activation (saved),
    a bucket (machinery), a temporary freed and its address reused by a saved tensor, an optimizer
    temporary freed and its address reused by a gradient the step keeps (the walk finds it there after the
    step: only the kept block is a gradient); entries from before the step lead the log."""
    t = (lambda us: base + us) if clock else (lambda us: None)
    before = [alloc(0x9000, 512, t=t(-50)), free(0x9000, 512, t=t(-40))]
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
            alloc(0x8000, 2048, ADAM, t(110))]                 # n5: at the same address, a gradient kept
    start = [(0x1000, 1024, []), (0x2000, 1024, []), (0x3000, 2048, []), (0x4000, 512, MODEL)]
    return {"trace": before + step, "start_blocks": start,
            "owners0": {0x1000: "params", 0x2000: "grads", 0x3000: "optimizer"},
            "owners1": {0x1000: "params", 0x2000: "grads", 0x3000: "optimizer", 0x8000: "grads"},
            "saved": [(101, 0x5000), (104, 0x7000), (104, 0x1000)],  # (allocations counted so far, address)
            "count0": 100, "count1": 106, "freed0": 7, "freed1": 12, "held0": 4608, "held1": 7168,
            "t0_ns": 1_000_000_000, "wall": 0.0002}


def test_the_log_gives_each_block_its_category_and_the_allocators_totals():
    got = history_series(recording())
    s, totals = got["series"], got["totals"]
    assert len(got["times"]) == len(got["ops"]) == len(totals) == 1 + 11  # the start, then the step's entries
    assert {c: v[0] for c, v in s.items()} == {"params": 1024, "grads": 1024, "optimizer": 2048,
                                               "activations": 0, "in_flight": 0, "temporaries": 512}
    assert [s["activations"][i] for i in (1, 5, 8)] == [4096, 4096 + 1024, 1024]
    assert s["in_flight"][2] == 8192 and s["in_flight"][-1] == 0
    assert s["temporaries"][3] == 1024 and s["temporaries"][4] == 512  # the freed temporary, then its address reused
    assert s["temporaries"][8] == max(s["temporaries"]) == 2048  # the optimizer's temporary (after the batch went)
    assert s["grads"][8] == 1024 and s["grads"][-1] == 1024 + 2048  # its address held a gradient at the end
    assert totals == [sum(v[i] for v in s.values()) for i in range(len(totals))]
    assert totals[-1] == 4608 - 512 + 1024 + 2048 == 7168               # held1: what the step ends with
    assert max(totals) == totals[got["peak_index"]] == 4608 + 4096 + 8192 + 1024 == 17920
    assert got["times"][1] == pytest.approx(10e-6) and got["times"] == sorted(got["times"])
    assert got["ops"][2].startswith("alloc 8,192 B stage0.py:190")
    top = got["alive_at_peak"]
    assert [r["nbytes"] for r in top[:2]] == [8192, 4096] and top[0]["category"] == "in_flight"
    assert sum(r["nbytes"] for r in top) == max(totals)


def test_a_wrong_reading_is_caught():
    rec = recording()
    rec["saved"] = [(103, 0x7000)]  # saved before the address was reused: the first block there
    s = history_series(rec)["series"]
    assert s["activations"][3] == 512 and s["activations"][5] == 0  # so the second one is a temporary
    wrong = recording()
    wrong["count0"] = 99  # a count one off: the earlier step's allocation is read as this step's, never freed
    assert history_series(wrong)["totals"][-1] == 7168 + 512 != wrong["held1"]  # what gpu_check compares
    lost = recording()
    lost["trace"] = lost["trace"][3:]  # the log's ring lost the step's first allocation
    with pytest.raises(HistoryError, match="5 of the step's 6 allocations"):
        history_series(lost)


def test_without_a_clock_the_samples_spread_over_the_step():
    got = history_series(recording(clock=False))
    assert got["times"][0] == 0.0 and got["times"][-1] == pytest.approx(0.0002)
    assert got["times"] == sorted(got["times"])
    other = history_series(recording(base=5_000))  # a clock that is not Unix time: the log's own spacing
    assert other["times"][1] == 0.0 and other["times"][-1] == pytest.approx(100e-6)  # its entries span 100 us
    assert history_series(recording())["times"][-1] == pytest.approx(110e-6)  # Unix time: since the step began


def test_machinery_is_judged_from_the_nearest_frame_outside_torch():
    assert frames_machinery(BUCKET)
    assert not frames_machinery(ADAM)  # the optimizer's temporaries are not machinery
    assert not frames_machinery(TORCH_NN + MODEL)
    assert frames_machinery([{"filename": f"{SITE}/torch/distributed/fsdp/_fully_shard/_fsdp_param.py"}])
    assert not frames_machinery([])
