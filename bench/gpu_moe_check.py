"""The mixture of experts on a GPU: run by hand where a GPU is lent, never by CI (``bench/gpu_check.py``'s twin).

Six checks, each one ``PASS``/``FAIL`` line; figures to ``bench/results/gpu_moe_check.json``:

1. ``forms``: ``colab_kit.models.experts.expert_compute`` in each of its three forms ("grouped_mm", "loop",
   "padded") on CUDA, fp32 (TF32 off) and bf16, forward and backward, against the loop in fp64 on the same
   rows: fp32 within 1e-5 relative (of the largest entry), bf16 within 2e-2. A form that raises is recorded with
   its error: on CUDA ``torch._grouped_mm`` may accept only some dtypes, and the default form must run.
2. ``speed``: forward + backward of the three forms in bf16 at DeepSeek-V3-like expert widths (64 experts,
   d 2,048, f 1,408; 65,536 rows routed at random), the median of 10 after 3 warm-ups, in ms and TFLOP/s of
   the six GEMMs: the GPU row of the table in ``experts.py``'s docstring.
3. ``parity``: the MoE GPT of ``tests/helpers/moe.py`` ("softmax": top-2, a shared expert, both losses, the
   bias) trained 4 steps through ``ck.boost`` on one GPU (NCCL, fp32, TF32 off) with AdamW and SGD + momentum
   against the one-process CPU reference of the same helper: within 1e-5 relative.
4. ``bf16``: a 12-layer MoE GPT (8 experts, top-2) through ``ck.boost(precision="bf16")``, 20 steps on real
   text (the bytes of ``argparse``'s source): the loss finite, and the last three steps' mean below both the
   first step's and the uniform loss ln 256 (learned something; random tokens, used before, have nothing to
   learn, so their loss only wandered around ln V); tokens/s measured.
5. ``etp_widths``: what expert tensor parallelism would leave each rank to compute: the grouped experts
   ("grouped_mm", bf16, forward + backward) at ``speed``'s sizes with the full width f 1,408 against f/2 (704,
   each rank's half at tp=2) and f/4 (352, tp=4), in ms and TFLOP/s, and ``time(f/2) / time(f)``: ETP at tp=2
   pays at least that on each rank, plus an all-reduce of the [rows, d] output (``docs/moe.md``). 0.50 would be
   a perfect split; PASS when each width ran.
6. ``syncs``: one training step of the MoE GPT and of a Hugging Face Mixtral under
   ``torch.cuda.set_sync_debug_mode("warn")``: every device->host sync by the line that made it; none inside a
   layer's records (``_seen``), at most one for the step's records (``expert.records.on_host``).

    python bench/gpu_moe_check.py               # every check
    python bench/gpu_moe_check.py syncs         # some of them again: the others' last results are kept
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import colab_kit as ck  # noqa: E402
from colab_kit.datasets import ByteText  # noqa: E402
from colab_kit.models import GPT, GPTConfig  # noqa: E402
from colab_kit.models.experts import expert_compute  # noqa: E402

try:
    from _results import machine, row  # noqa: E402
    from _gpu_copies import host_syncs  # noqa: E402
except ImportError:  # python -m bench.gpu_moe_check
    from bench._results import machine, row  # noqa: E402
    from bench._gpu_copies import host_syncs  # noqa: E402

FORMS = ("grouped_mm", "loop", "padded")


def _tf32_off():
    import importlib
    importlib.import_module("torch.backends.cuda").matmul.allow_tf32 = False
    importlib.import_module("torch.backends.cudnn").allow_tf32 = False


def _inputs(n, d, f, rows, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=gen, dtype=torch.float64)
    counts = torch.bincount(torch.randint(0, n, (rows,), generator=gen), minlength=n)
    counts[1] = 0  # an expert that receives no row
    counts[0] += rows - int(counts.sum())
    ws = [torch.randn(*s, generator=gen, dtype=torch.float64).mul_(0.05) for s in ((n, d, f), (n, f), (n, f, d), (n, d))]
    leaves = [t.to(device, dtype).requires_grad_() for t in (x, *ws)]
    return leaves, counts.to(device)


def _run(form, leaves, counts):
    for t in leaves:
        t.grad = None
    out = expert_compute(leaves[0], counts, *leaves[1:], how=form)
    out.square().sum().backward()
    return [out.detach()] + [t.grad.detach() for t in leaves]


def check_forms():
    _tf32_off()
    figures, ok = {}, True
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        ref_leaves, counts = _inputs(8, 256, 512, 4096, torch.float64, "cuda")
        want = _run("loop", ref_leaves, counts)
        for form in FORMS:
            name = f"{form} {str(dtype).split('.')[-1]}"
            leaves, counts = _inputs(8, 256, 512, 4096, dtype, "cuda")
            try:
                got = _run(form, leaves, counts)
            except Exception as exc:  # recorded: which dtypes the CUDA kernel takes
                figures[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                ok = ok and form != "grouped_mm"  # the default form must run in both dtypes
                continue
            rel = max(float((g.double() - w).abs().max() / w.abs().max().clamp_min(1e-30)) for g, w in zip(got, want))
            figures[name] = {"max_rel": rel, "tol": tol}
            ok = ok and rel <= tol
    detail = "; ".join(f"{k}: {v.get('error') or format(v['max_rel'], '.1e')}" for k, v in figures.items())
    return ok, figures, detail


def check_speed():
    n, d, f, rows = 64, 2048, 1408, 65536
    leaves, counts = _inputs(n, d, f, rows, torch.bfloat16, "cuda", seed=1)
    flops = 3 * 2 * (2 * rows * d * f)  # two GEMMs, forward + two in backward each
    figures = {"experts": n, "d": d, "f": f, "rows": rows, "dtype": "bf16"}
    for form in FORMS:
        try:
            times = []
            for i in range(13):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                _run(form, leaves, counts)
                torch.cuda.synchronize()
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            ms = 1e3 * sorted(times)[len(times) // 2]
            figures[form] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
        except Exception as exc:
            figures[form] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    ok = "ms" in figures["grouped_mm"]
    detail = ", ".join(f"{k} {v['ms']} ms ({v['tflops']} TFLOP/s)" if "ms" in v else f"{k} {v['error']}"
                       for k, v in figures.items() if isinstance(v, dict))
    return ok, figures, detail


def _time_grouped(leaves, counts, repeat=10, warmup=3):
    """Median ms of forward + backward of the grouped form after ``warmup`` runs."""
    times = []
    for i in range(warmup + repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _run("grouped_mm", leaves, counts)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def check_etp_widths():
    n, d, f, rows = 64, 2048, 1408, 65536
    figures = {"experts": n, "d": d, "rows": rows, "dtype": "bf16", "form": "grouped_mm"}
    for name, width in (("f", f), ("f/2", f // 2), ("f/4", f // 4)):
        leaves, counts = _inputs(n, d, width, rows, torch.bfloat16, "cuda", seed=1)
        ms = _time_grouped(leaves, counts)
        flops = 3 * 2 * (2 * rows * d * width)  # as speed: two GEMMs, forward + two in backward each
        figures[name] = {"f": width, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1)}
        del leaves
        torch.cuda.empty_cache()
    figures["half_over_full"] = round(figures["f/2"]["ms"] / figures["f"]["ms"], 3)
    figures["quarter_over_full"] = round(figures["f/4"]["ms"] / figures["f"]["ms"], 3)
    detail = ", ".join(f"{k} ({v['f']}) {v['ms']} ms ({v['tflops']} TFLOP/s)" for k, v in figures.items()
                       if isinstance(v, dict))
    detail += (f"; time(f/2)/time(f) {figures['half_over_full']}, time(f/4)/time(f) {figures['quarter_over_full']}"
               " (0.50 / 0.25: a perfect split)")
    return True, figures, detail


def _rank_syncs(model: str):
    """One training step of ``model`` (the built-in MoE GPT "softmax" or the HF "mixtral" of the tests) on the
    GPU under ``torch.cuda.set_sync_debug_mode("warn")``, after a warm-up step: each host sync it made, by the
    Python line that made it."""
    sys.path.insert(0, ROOT)
    from tests.helpers.moe import BATCH, OPTIMIZERS, data
    if model == "mixtral":
        from tests.helpers.hf_moe import build
    else:
        from tests.helpers.moe import build
    engine = ck.boost(build(model), OPTIMIZERS["sgd"], ck.ParallelConfig())
    d = data()
    engine.train_step(d.batch(0, BATCH))
    r = host_syncs(lambda: engine.train_step(d.batch(1, BATCH)))
    engine.close()
    return {"syncs": r["syncs"], "sites": r["sites"]}


def check_syncs():
    """The MoE records cost one host read per step (``expert.records.on_host``), none inside a layer's
    ``_seen``: every sync of one step, by line, for the built-in MoE GPT and a Hugging Face Mixtral."""
    import inspect
    from colab_kit.models import moe as moe_module
    from colab_kit.models import hf_moe
    lines = {}
    for fn in (moe_module.MoE._seen, hf_moe._seen):
        src, first = inspect.getsourcelines(fn)
        lines[os.path.relpath(inspect.getsourcefile(fn), ROOT)] = range(first, first + len(src))
    figures, ok = {}, True
    for model in ("softmax", "mixtral"):
        r = ck.launch(_rank_syncs, 1, model, backend="nccl", timeout=300)[0]
        in_seen = {k: n for k, n in r["sites"].items() if k.rsplit(":", 1)[0] in lines
                   and int(k.rsplit(":", 1)[1]) in lines[k.rsplit(":", 1)[0]]}
        records = sum(n for k, n in r["sites"].items() if k.startswith("colab_kit/expert/records.py"))
        figures[model] = {**r, "in_seen": in_seen, "records": records}
        ok = ok and not in_seen and records <= 1
    detail = "; ".join(f"{m}: {f['syncs']} syncs a step, {f['records']} for the records, "
                       f"{sum(f['in_seen'].values())} in _seen" for m, f in figures.items())
    return ok, figures, detail


def _rank_parity(opt):
    _tf32_off()
    sys.path.insert(0, ROOT)
    from tests.helpers.moe import BATCH, MODELS, OPTIMIZERS, STEPS, data
    engine = ck.boost(GPT(MODELS["softmax"]), OPTIMIZERS[opt], ck.ParallelConfig())
    d = data()
    losses = [engine.train_step(d.batch(s, BATCH)) for s in range(STEPS)]
    dev = str(engine.mesh.device)
    where = sorted({str(p.device) for p in engine.module.parameters()})  # every weight on the GPU, not one
    engine.close()
    return {"losses": losses, "device": dev, "parameter_devices": where}


def check_parity():
    from tests.helpers.moe import reference
    from colab_kit.engine.reference import max_relative_difference
    figures, ok = {}, True
    for opt in ("adamw", "sgd"):
        want = reference("softmax", opt)
        got = ck.launch(_rank_parity, 1, opt, backend="nccl", timeout=300)[0]
        rel = max_relative_difference(got["losses"], want)
        figures[opt] = {**got, "reference": want, "max_rel": rel}
        ok = ok and got["parameter_devices"] == ["cuda:0"] and rel <= 1e-5
    return ok, figures, ", ".join(f"{k} {v['max_rel']:.1e} on {v['parameter_devices']}" for k, v in figures.items())


def _rank_bf16():
    import argparse  # its source is the text: real bytes, nothing downloaded
    cfg = GPTConfig(vocab_size=256, seq_len=512, d_model=512, n_heads=8, n_layers=12, n_experts=8, top_k=2,
                    d_expert=1024, aux_loss=0.01)
    engine = ck.boost(GPT(cfg), lambda ps: torch.optim.AdamW(ps, lr=6e-4), ck.ParallelConfig(precision="bf16"))
    data = ByteText(argparse, seq_len=cfg.seq_len, seed=2)
    losses = [engine.train_step(data.batch(s, 16)) for s in range(20)]
    tput = ck.throughput(engine)
    engine.close()
    return {"losses": losses, "tokens_per_s": tput.get("tokens_per_s"), "max_memory_allocated": torch.cuda.max_memory_allocated()}


def check_bf16():
    r = ck.launch(_rank_bf16, 1, backend="nccl", timeout=300)[0]
    losses = r["losses"]
    uniform = math.log(256)  # the loss of a model that learned nothing of the bytes
    ok = all(map(math.isfinite, losses)) and sum(losses[-3:]) / 3 < min(losses[0], uniform)
    return ok, r, (f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (uniform {uniform:.3f}), "
                   f"{r['tokens_per_s'] or 0:,.0f} tokens/s")


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_moe_check: no CUDA device here", file=sys.stderr)
        return 2
    results, only = {}, sys.argv[1:]  # check names to run, all by default
    for name, fn in (("parity", check_parity), ("bf16", check_bf16), ("forms", check_forms), ("speed", check_speed),
                     ("etp_widths", check_etp_widths), ("syncs", check_syncs)):
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            ok, figures, detail = fn()
        except Exception as exc:
            ok, figures, detail = False, {"traceback": traceback.format_exc()}, f"raised {type(exc).__name__}: {exc}"
        secs = time.perf_counter() - t0
        results[name] = {"status": "PASS" if ok else "FAIL", "seconds": round(secs, 2), "detail": detail,
                         "figures": figures, "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
        print(f"{'PASS' if ok else 'FAIL'}  {name:<8} {secs:6.1f} s  {detail}", flush=True)
        _write(results, only)  # after each check: a run cut off by a timeout keeps what it finished
    return 0 if all(r["status"] == "PASS" for r in results.values()) else 1


def _write(results: dict, only: list) -> None:
    """``bench/results/gpu_moe_check.json``: this run's checks so far, and (a run of some checks) the others'
    last results, each with its ``when``."""
    out = os.path.join(ROOT, "bench", "results", "gpu_moe_check.json")
    checks = dict(results)
    if only and os.path.exists(out):  # some checks run again: the others' last results stay, each with its "when"
        with open(out, encoding="utf-8") as fh:
            earlier = json.load(fh)
        checks = {**{k: {"when": earlier.get("when"), **v} for k, v in earlier.get("checks", {}).items()}, **results}
    now = time.strftime("%Y-%m-%dT%H:%M:%S")
    with open(out, "w", encoding="utf-8") as fh:  # the keys every result file has (bench/report.py)
        json.dump({"benchmark": "gpu_moe_check", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "command": " ".join(["python", "bench/gpu_moe_check.py", *sys.argv[1:]]),
                   "when": now, "machine": machine(), "checks": checks,
                   "rows": [row(f"GPU MoE check: {name}", r["status"], None, None, r["detail"])
                            for name, r in checks.items()]}, fh, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
