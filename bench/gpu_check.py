"""Checks of colab_kit on a GPU machine (CUDA, NCCL); run by hand where a GPU is lent, never by CI.

Eight checks, in this order, each a function below (``check_*``); one that raises is a FAIL with its
message and the others still run. Each prints one ``PASS``/``FAIL`` line with its seconds:

1. NCCL through both entry points. ``launch``: ``ck.launch(fn, gpus)`` runs one rank per GPU on NCCL;
   each rank must sit on ``cuda:LOCAL_RANK`` and an all_reduce of ``rank + 1`` give ``w (w + 1) / 2``.
   ``torchrun``: this script starts itself under ``python -m torch.distributed.run --standalone
   --nproc-per-node=<gpus>`` (hidden flag ``--torchrun-child``), where ``ck.init()`` must pick NCCL and
   ``cuda:LOCAL_RANK`` and the all_reduce be right; rank 0 prints every rank's report as one JSON line.
2. ``gpt``: a GPT of 125,164,032 parameters (vocab 25,600, 1,024 tokens, d_model 768, 12 heads, 12
   layers: GPTConfig's head is untied, so GPT-2's 50,257 words would make 163M) trained 30 steps with
   ``precision="bf16"`` through ``ck.boost``; the loss must be finite and fall; tokens/s and MFU come from
   ``ck.throughput(engine)`` (``colab_kit.observe.throughput``: ``model_flops`` over the bf16 matmul peak that
   ``peak_matmul`` measures on this GPU, never a datasheet figure), and MFU must lie in (0, 1].
3. ``zero3_budget``: ZeRO-3, fp32, ``offload="auto"`` under ``boost(..., device_budget=B)``. A probe engine
   with every chunk on the host measures what a step needs on the device beside the states (what "auto"
   measures in its first step); B is that plus half the states, so some chunks must stay on the host.
   Then chunks on the host hold only CPU tensors (shard, gradient, optimizer states), chunks on the device
   only CUDA ones; the engine's account stays within B; and ``torch.cuda.max_memory_allocated()`` in each
   step after the first stays within B plus an allowance (384 MiB, printed beside it) for what the account
   does not see: allocator rounding, cuBLAS/cuBLASLt workspaces, and backward's transient activation
   gradients (the activation meter counts saved tensors). The allowance must be below the states kept on
   the host, so an engine that ignored the budget would fail. Then the same model in bf16 with
   ``offload="cpu"`` trains 3 steps to finite losses (its host shards pinned on a GPU; ZeRO-3 frees the widened
   16-bit gradients by resizing their storage).
4. ``parity``: the CPU suite's parity configs (``tests/ranks/test_dp.py``, ``test_zero.py``, ``test_zero3.py``)
   and their one-rank forms, each whose world size fits on the GPUs, train the suite's GPT 5 steps with
   AdamW and with SGD + momentum to the losses of ``colab_kit.engine.reference.train_single_process`` (one CPU
   process) within 1e-5 relative; the configs that need more GPUs are listed by name as skipped. TF32 is
   off in these ranks (``torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 =
   False``; with it fp32 matmuls keep 10-bit mantissas and parity is lost). Beside the verdict, plain
   torch on the same device against the CPU reference: the device's own rounding, for diagnosis.
5. ``memory_history``: ``ck.memory_timeline(engine, batch)`` on one GPU reads CUDA's allocator log
   (``colab_kit.memory.history``, in requested bytes): its timeline must end at the allocator's
   ``requested_bytes.all.current`` and peak at that counter's peak over the step, to the byte, at most the
   step's ``max_memory_allocated()``; hold the engine's parameter bytes exactly; reach the dispatch meter's
   activations within 10%; and its snapshot pickle must load.
   On CPU ranks ``method="history"`` must be refused with the way out.
6. ``shared_gpu``: several ranks on one GPU (NCCL refuses that: ``comm/rules/staging.py``). The multi-rank
   parity configs and ring x pp, Ulysses x ZeRO-3 and tp x ZB-H1, on 2, 4 and 8 ranks of ``nccl_rules`` with
   ``COLAB_KIT_RULES_DEVICE=cuda``: every rank's engine on cuda, every collective and message through pinned
   host buffers, each trained to one process's losses (fp32, 1e-5, TF32 off). In the smoke, CPU tensors staged
   the same way (``COLAB_KIT_RULES_STAGE=1``). Ring attention's fused CUDA kernels are probed there on their
   first block (``colab_kit.sequence.ring_kernels.PROBED``: admitted, or why not), and recorded.
7. ``offload_copies``: ZeRO-3 ``offload="cpu"`` in bf16 with its host <-> device copies on the compute stream
   against a side stream (``colab_kit/zero/copies.py``; ``bench/_gpu_copies.py``): the same losses bit for bit,
   step times side by side, host syncs per step, and the share of the copies' time beside compute kernels.

The parity and shared_gpu rows also record the host syncs of one more step of each config
(``torch.cuda.set_sync_debug_mode``, by line; under ``shared_gpu`` those of the staging apart).

All figures go to ``bench/results/gpu_check.json`` (device, torch, each check's status, seconds, figures).
Exit 0 when all pass, 1 when one fails, 2 without CUDA (and without ``--cpu-smoke``).

``--cpu-smoke``: the same checks and code paths on CPU ranks with gloo under NCCL's rules (``nccl_rules``), in about 20 s: 2 ranks for
``launch`` and ``torchrun``, a GPT of 5,616 parameters in bf16 (as on the GPU), the budget held against the engine's
account only (there is no CUDA allocator), parity as on one GPU. Its JSON goes to ``--out`` (default: a
temp file), never over the GPU figures::

    python bench/gpu_check.py
    python bench/gpu_check.py --cpu-smoke --out /tmp/gpu_check_smoke.json
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python bench/gpu_check.py` from a checkout without an installed colab_kit
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import colab_kit as ck  # noqa: E402
from colab_kit.datasets import ByteText, SyntheticTokens  # noqa: E402
from colab_kit.models import GPT, GPTConfig  # noqa: E402
from colab_kit.engine.reference import max_relative_difference, train_single_process  # noqa: E402

try:
    from _results import machine, row  # noqa: E402
    from _gpu_copies import check_offload_copies, host_syncs  # noqa: E402
except ImportError:  # run as a module (python -m bench.gpu_check)
    from bench._results import machine, row  # noqa: E402
    from bench._gpu_copies import check_offload_copies, host_syncs  # noqa: E402

RTOL = 1e-5  # fp32 parity, as the CPU suite
MARK = "gpu_check torchrun report: "
MIB = 1 << 20
SIZES = {  # per mode: the GPT of check 2 and the ZeRO-3 model of check 3
    "cuda": dict(gpt=dict(vocab_size=25600, seq_len=1024, d_model=768, n_heads=12, n_layers=12), gpt_batch=16,
                 gpt_steps=30, lr=6e-4, precision="bf16", allowance=384 * MIB, zero_batch=8, zero_steps=5,
                 zero=dict(vocab_size=4096, seq_len=256, d_model=1024, n_heads=16, n_layers=8)),  # 109M
    "cpu": dict(gpt=dict(vocab_size=64, seq_len=16, d_model=16, n_heads=2, n_layers=1), gpt_batch=8,
                gpt_steps=8, lr=1e-2, precision="bf16", allowance=0, zero_batch=8, zero_steps=4,
                zero=dict(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)),
}
PARITY_MODEL = dict(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)  # tests/ranks/test_dp.py's GPT_CFG
PARITY_STEPS, PARITY_BATCH = 5, 8
OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9)}
PARITY_CONFIGS = [  # one-rank forms first, then the suite's multi-rank configs
    dict(dp=1), dict(dp=1, zero=1), dict(dp=1, zero=2), dict(dp=1, zero=3), dict(dp=1, zero=1, offload="cpu"),
    dict(dp=1, zero=2, offload="cpu"), dict(dp=1, zero=3, offload="cpu"), dict(dp=1, zero=3, offload="auto"),
    dict(dp=2), dict(dp=2, zero=1), dict(dp=2, zero=2), dict(dp=2, zero=3), dict(dp=2, zero=1, offload="cpu"),
    dict(dp=2, zero=3, offload="cpu"), dict(dp=2, zero=3, offload="auto"), dict(dp=4, zero=3),
    dict(dp=2, tp=2, zero=2), dict(dp=2, tp=2, zero=3), dict(dp=2, pp=2, zero=2, microbatches=2, schedule="1f1b"),
    dict(dp=2, tp=4, tp_mode="2d", zero=3)]


# ------------------------------------------------------------------ helpers (also used by the tests)
def parity(got, want, rtol: float = RTOL) -> dict:
    """PASS when ``got`` has as many losses as ``want``, all finite, each within ``rtol`` relative."""
    if len(got) != len(want) or not all(math.isfinite(x) for x in got):
        return {"status": "FAIL", "max_rel": None, "why": f"{len(got)} losses for {len(want)}, or not finite"}
    worst = max_relative_difference(got, want)
    return {"status": "PASS" if worst <= rtol else "FAIL", "max_rel": worst}


def run_checks(checks, ctx, after=None) -> dict:
    """Run ``(name, fn)`` in order; ``fn(ctx) -> (ok, figures, detail)``. One that raises is a FAIL.
    ``after(results so far)`` is called after each check (``main`` writes the file each time, so a check that
    the outer ``timeout`` kills loses only itself)."""
    out = {}
    for name, fn in checks:
        t0 = time.perf_counter()
        try:
            ok, figures, detail = fn(ctx)
        except Exception as exc:  # a broken check is a result, not the end of the run
            text = exc.summary() if isinstance(exc, ck.RankError) else str(exc)  # a rank's: "rank 0 failed ..: why"
            lines = text.strip().splitlines() or [""]
            ok, detail = False, f"raised {type(exc).__name__}: {lines[0] if isinstance(exc, ck.RankError) else lines[-1]}"
            figures = {"error": str(exc), "traceback": traceback.format_exc()}
        secs = time.perf_counter() - t0
        out[name] = {"status": "PASS" if ok else "FAIL", "seconds": round(secs, 2), "detail": detail, "figures": figures}
        print(f"{'PASS' if ok else 'FAIL'}  {name:<13} {secs:6.1f} s  {detail}", flush=True)
        if after is not None:
            after(out)
    return out


def _fp32_exact() -> None:
    """No TF32 in this process: fp32 matmuls and convolutions at full precision (parity needs it). The
    modules are looked up by name: cloudpickle (ck.launch ships this script's functions by value) cannot
    pickle ``torch.backends.cudnn``, a module subclass, that a plain attribute chain here would make it carry."""
    import importlib
    importlib.import_module("torch.backends.cuda").matmul.allow_tf32 = False  # torch.backends.cuda.matmul
    importlib.import_module("torch.backends.cudnn").allow_tf32 = False  # torch.backends.cudnn


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _launch(ctx, fn, world, *args):
    return ck.launch(fn, world, *args, backend=ctx["backend"], timeout=ctx["timeout"], threads=ctx["threads"])


def _where_am_i() -> dict:
    """This rank's backend and device, and an all_reduce of rank + 1 over the world."""
    import torch.distributed as dist
    cuda = dist.get_backend() == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    t = torch.tensor([float(dist.get_rank() + 1)], device=dev)
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "local_rank": int(os.environ["LOCAL_RANK"]), "backend": dist.get_backend(),
            "device": str(t.device), "sum": t.item(), "world": dist.get_world_size(),
            "name": torch.cuda.get_device_name(dev) if cuda else "cpu"}


def _ranks_ok(ctx, ranks) -> bool:
    w = len(ranks)
    want = "cuda:{}" if ctx["cuda"] else "cpu"
    return w == ctx["world"] and all(r["backend"] == ctx["backend"] and r["sum"] == w * (w + 1) / 2
                                     and r["device"] == want.format(r["local_rank"]) for r in ranks)


# ------------------------------------------------------------------ 1. NCCL through ck.launch and ck.init
def check_launch(ctx):
    """``ck.launch(fn, gpus)``: NCCL, each rank on cuda:LOCAL_RANK, the all_reduce's sum right."""
    ranks = _launch(ctx, _where_am_i, ctx["world"])
    return _ranks_ok(ctx, ranks), {"ranks": ranks}, f"{len(ranks)} ranks: " + ", ".join(
        f"{r['backend']} {r['device']} sum {r['sum']:g}" for r in ranks)


def _torchrun_child(smoke: bool) -> int:
    import torch.distributed as dist
    job = ck.init(backend="nccl_rules" if smoke else None)
    mine = {**_where_am_i(), "launcher": job.launcher if job is not None else None}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        print(MARK + json.dumps(every), flush=True)
    dist.destroy_process_group()
    return 0


def check_torchrun(ctx):
    """This script under torchrun: ``ck.init()`` picks NCCL and cuda:LOCAL_RANK on every rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ctx['world']}",
           os.path.abspath(__file__), "--torchrun-child"] + (["--cpu-smoke"] if not ctx["cuda"] else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx["timeout"], env=env)
    lines = [ln[ln.index(MARK) + len(MARK):] for ln in proc.stdout.splitlines() if MARK in ln]
    if proc.returncode or not lines:
        raise RuntimeError(f"torchrun exited {proc.returncode} without a report: {proc.stderr[-2000:]}")
    ranks = json.loads(lines[-1])
    ok = _ranks_ok(ctx, ranks) and all(r["launcher"] == "torchrun" for r in ranks)
    return ok, {"ranks": ranks, "command": " ".join(cmd[1:])}, f"{len(ranks)} ranks: " + ", ".join(
        f"{r['backend']} {r['device']} (LOCAL_RANK {r['local_rank']})" for r in ranks)


# ------------------------------------------------------------------ 2. a GPT of 125M in bf16: tokens/s, MFU
def _rank_gpt(sizes):
    from colab_kit.observe.throughput import format_throughput
    cfg = GPTConfig(**sizes["gpt"])
    model = GPT(cfg)
    n = model.num_parameters()
    engine = ck.boost(model, lambda ps: torch.optim.AdamW(ps, lr=sizes["lr"]),
                      ck.ParallelConfig(precision=sizes["precision"]))
    import argparse  # its source is the text: real bytes, nothing downloaded
    # real text falls fast and far (the H200's random tokens fell 10.31 -> 10.25, within their step-to-step
    # noise of 0.1); the CPU smoke's vocabulary of 64 is smaller than a byte's
    data = ByteText(argparse, seq_len=cfg.seq_len, seed=2) if cfg.vocab_size >= 256 else \
        SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=2)
    losses = [engine.train_step(data.batch(s, sizes["gpt_batch"])) for s in range(sizes["gpt_steps"])]
    tput = ck.throughput(engine)  # the steps after the first, against this device's measured peak
    cuda = engine.mesh.device.type == "cuda"
    engine.close()
    return {"parameters": n, "model": sizes["gpt"], "batch": [sizes["gpt_batch"], cfg.seq_len],
            "precision": sizes["precision"], "losses": losses, "throughput": tput, "line": format_throughput(tput),
            "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None}


def check_gpt(ctx):
    """GPT (125M on CUDA) through ck.boost in bf16: finite, falling loss; tokens/s and MFU measured."""
    r = _launch(ctx, _rank_gpt, 1, ctx["sizes"])[0]
    losses, tp = r["losses"], r["throughput"]
    ok = (all(math.isfinite(x) for x in losses) and sum(losses[-3:]) / 3 < losses[0]
          and tp["tokens_per_s"] > 0 and 0 < tp["mfu"] <= 1)
    return ok, r, (f"{r['parameters']:,} params {r['precision']}: loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
                   f"{r['line']}")


# ------------------------------------------------------------------ 3. ZeRO-3 offload="auto" under a budget
def _adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-3)


def _probe_budget(cfg, factory, batch, config_kw) -> tuple[int, int]:
    """(what one step holds on the device with every chunk on the host, the chunks' state bytes)."""
    probe = ck.boost(GPT(cfg), factory, ck.ParallelConfig(**{**config_kw, "offload": "cpu"}))
    probe.train_step(SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=1).batch(0, batch))
    place = probe.data_parallel.placement
    out = place.account.peak, sum(place.state_bytes(i) for i in range(len(place.chunks)))
    probe.close()
    del probe, place
    gc.collect()  # nothing of the probe left on the device before the engine under test is measured
    return out


def _rank_budget(sizes):
    _fp32_exact()
    cfg, batch = GPTConfig(**sizes["zero"]), sizes["zero_batch"]
    measured, states = _probe_budget(cfg, _adamw, batch, dict(zero=3))
    cuda = torch.distributed.get_backend() == "nccl"
    if cuda:
        torch.cuda.empty_cache()
    budget = measured + states // 2
    engine = ck.boost(GPT(cfg), _adamw, ck.ParallelConfig(zero=3, offload="auto"), device_budget=budget)
    data, losses, peaks = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=1), [], []
    for s in range(sizes["zero_steps"]):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        losses.append(engine.train_step(data.batch(s, batch)))
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
    place = engine.data_parallel.placement
    kinds = [sorted({t.device.type for t in place.state_tensors(i) if t is not None}) for i in range(len(place.chunks))]
    host = sum(place.state_bytes(i) for i, w in enumerate(place.where) if w == "host")
    out = {"model": sizes["zero"], "batch": batch, "budget": budget, "step_need_measured": measured,
           "state_bytes": states, "host_state_bytes": host, "where": list(place.where), "tensor_devices": kinds,
           "account_peak": place.account.peak, "cuda_peaks": peaks, "losses": losses,
           "device_type": engine.mesh.device.type}
    engine.close()
    del engine, place
    gc.collect()
    # bf16 with every chunk on the host (pinned, on a GPU): ZeRO-3 frees each widened 16-bit shard gradient by
    # resizing its storage, which a Tensor.pin_memory() storage refuses ("not resizable", at the first step)
    mixed = ck.boost(GPT(cfg), _adamw, ck.ParallelConfig(zero=3, offload="cpu", precision="bf16"))
    out["bf16_offload_losses"] = [mixed.train_step(data.batch(s, batch)) for s in range(3)]
    mixed.close()
    return out


def check_zero3_budget(ctx):
    """ZeRO-3 offload='auto': tensors where placed, account and CUDA peak (steps 2+) within the budget."""
    r = _launch(ctx, _rank_budget, 1, ctx["sizes"])[0]
    allow, dev = ctx["sizes"]["allowance"], r["device_type"]
    placed = all(k == ([dev] if w == "device" else ["cpu"]) for k, w in zip(r["tensor_devices"], r["where"]))
    sides = {"device", "host"} <= set(r["where"])
    mixed = r["bf16_offload_losses"]
    ok = (placed and sides and r["account_peak"] <= r["budget"] and all(map(math.isfinite, r["losses"]))
          and all(map(math.isfinite, mixed)))
    detail = (f"{r['where'].count('host')}/{len(r['where'])} chunks on the host, tensors where placed: {placed}; "
              f"budget {r['budget']:,} B, account peak {r['account_peak']:,} B; bf16 offload='cpu' loss "
              f"{mixed[0]:.3f} -> {mixed[-1]:.3f}")
    if ctx["cuda"]:
        cuda_peak = max(r["cuda_peaks"][1:])
        r.update(cuda_peak_after_first=cuda_peak, allowance=allow, beyond_budget=cuda_peak - r["budget"])
        ok = ok and cuda_peak <= r["budget"] + allow and allow < r["host_state_bytes"]
        detail += (f"; CUDA max_memory_allocated steps 2-{len(r['cuda_peaks'])} {cuda_peak:,} B "
                   f"({cuda_peak - r['budget']:+,} B vs the budget; allowance {allow:,} B for allocator rounding, "
                   f"cuBLAS workspaces, backward's transient gradients)")
    else:
        detail += " (CPU: the engine's account is the device; no CUDA allocator to read)"
    return ok, r, detail


# ------------------------------------------------------------------ 4. the suite's parity configs that fit
def _name(kw: dict) -> str:
    """A config by its fields: ``dp=2 zero=3 offload=cpu``."""
    return " ".join(f"{k}={v}" for k, v in kw.items())


def _rel(x) -> str:
    return "n/a" if x is None else f"{x:.2e}"


def _plain_torch(cfg, factory, data, device) -> list[float]:
    """One process with nothing but torch on this rank's device: how far its fp32 is from the CPU's."""
    from colab_kit.engine.core import lm_loss
    model, out = GPT(cfg).to(device), []
    opt = factory(model.parameters())
    for s in range(PARITY_STEPS):
        x, y = (t.to(device) for t in data.batch(s, PARITY_BATCH))
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _rank_parity(configs, plain: bool):
    _fp32_exact()
    cfg, rows = GPTConfig(**PARITY_MODEL), []
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=1)
    if plain:  # a diagnosis beside the verdict: the device's own rounding against the CPU reference
        import torch.distributed as dist
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        rows += [{"config": "plain torch", "optimizer": opt, "losses": _plain_torch(cfg, f, data, dev),
                  "device": str(dev)} for opt, f in OPTIMIZERS.items()]
    for kw in configs:
        for opt, factory in OPTIMIZERS.items():
            budget = None
            if kw.get("offload") == "auto":
                measured, states = _probe_budget(cfg, factory, PARITY_BATCH, {k: v for k, v in kw.items()
                                                                              if k != "offload"})
                budget = measured + states // 2
            engine = ck.boost(GPT(cfg), factory, ck.ParallelConfig(**kw), device_budget=budget)
            losses = [engine.train_step(data.batch(s, PARITY_BATCH)) for s in range(PARITY_STEPS)]
            syncs = host_syncs(lambda: engine.train_step(data.batch(PARITY_STEPS, PARITY_BATCH)))  # one more step
            rows.append({"config": _name(kw), "optimizer": opt, "losses": losses,
                         "device": str(engine.mesh.device), "host_syncs": syncs})
            engine.close()
    return rows


def check_parity(ctx):
    """The suite's configs that fit on the devices = one process's losses (fp32, 1e-5, TF32 off)."""
    fits = [kw for kw in PARITY_CONFIGS if ck.ParallelConfig(**kw).world_size <= ctx["devices"]]
    skipped = [_name(kw) for kw in PARITY_CONFIGS if kw not in fits]
    refs = _references()
    rows = []
    for world in sorted({ck.ParallelConfig(**kw).world_size for kw in fits}):
        group = [kw for kw in fits if ck.ParallelConfig(**kw).world_size == world]
        rows += _launch(ctx, _rank_parity, world, group, not rows)[0]
    for row in rows:
        row.update(parity(row["losses"], refs[row["optimizer"]]))
    plain, rows = [r for r in rows if r["config"] == "plain torch"], [r for r in rows if r["config"] != "plain torch"]
    bad = [f"{r['config']} {r['optimizer']} ({_rel(r['max_rel'])})" for r in rows if r["status"] != "PASS"]
    worst = max((r["max_rel"] for r in rows if r["max_rel"] is not None), default=float("nan"))
    ok = bool(rows) and not bad
    mine = ", ".join(f"{r['optimizer']} {_rel(r['max_rel'])}" for r in plain)
    detail = (f"{len(rows)} runs ({len(fits)} configs x {len(OPTIMIZERS)} optimizers), worst rel {_rel(worst)} "
              f"(<= {RTOL:g}, TF32 off){'; FAILED: ' + '; '.join(bad) if bad else ''}; plain torch on "
              f"{plain[0]['device'] if plain else '?'} vs the CPU reference: {mine}; skipped, need more than "
              f"{ctx['devices']} device(s): {'; '.join(skipped) or 'none'}")
    return ok, {"rows": rows, "plain_torch": plain, "reference": refs, "skipped": skipped, "rtol": RTOL,
                "tf32": False}, detail


# ------------------------------------------------------------------ 6. several ranks sharing the GPU
SHARED_CONFIGS = [kw for kw in PARITY_CONFIGS if kw.get("dp", 1) * kw.get("tp", 1) * kw.get("pp", 1) > 1] + [
    dict(sp=2, pp=2, microbatches=4, schedule="1f1b"), dict(dp=2, sp=2, sp_mode="ulysses", zero=3),
    dict(tp=2, pp=2, microbatches=4, schedule="zb-h1")]
"""The multi-rank parity configs, and ring x pp, Ulysses x ZeRO-3 and tp x ZB-H1 (every kind of call)."""


def _rank_shared(configs):
    import torch.distributed as dist

    from colab_kit.sequence.ring_kernels import PROBED
    staged = bool(getattr(dist.distributed_c10d._get_default_group(), "staging", False))
    rows = _rank_parity(configs, False)
    kernels = {f"{d} {str(t).removeprefix('torch.')} head dim {h}": v for (d, t, h), v in PROBED.items()}
    return [{**r, "staged": staged, "ring_kernels": kernels} for r in rows]


def check_shared_gpu(ctx):
    """Several ranks on one GPU (``comm/rules/staging.py``): each config of ``SHARED_CONFIGS`` on 2 to 8 ranks of
    ``nccl_rules`` with ``COLAB_KIT_RULES_DEVICE=cuda``, every rank's engine on cuda, every call staged through
    pinned host buffers, trains to one process's losses (fp32, 1e-5, TF32 off). The CPU smoke stages CPU
    tensors (``COLAB_KIT_RULES_STAGE=1``): the same code, without a GPU. Each staged call is a host sync: no
    timing here says anything about a run on NCCL."""
    env = {"COLAB_KIT_RULES_DEVICE": "cuda"} if ctx["cuda"] else {"COLAB_KIT_RULES_STAGE": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # ck.launch hands them to the ranks (launch.RULES_ENV)
    rows = []
    try:
        for world in sorted({ck.ParallelConfig(**kw).world_size for kw in SHARED_CONFIGS}):
            group = [kw for kw in SHARED_CONFIGS if ck.ParallelConfig(**kw).world_size == world]
            t0 = time.perf_counter()
            rows += ck.launch(_rank_shared, world, group, backend="nccl_rules", threads=ctx["threads"],
                              timeout=min(ctx["timeout"], 60.0))[0]  # a hang reported, inside the outer timeout
            print(f"      shared_gpu: {len(group)} config(s) on {world} ranks in {time.perf_counter() - t0:.1f} s",
                  flush=True)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    refs = _references()
    for r in rows:
        r.update(parity(r["losses"], refs[r["optimizer"]]))
    device = "cuda" if ctx["cuda"] else "cpu"
    bad = [f"{r['config']} {r['optimizer']} ({_rel(r['max_rel'])}, {r['device']}, staged {r['staged']})"
           for r in rows if r["status"] != "PASS" or not r["device"].startswith(device) or not r["staged"]]
    worst = max((r["max_rel"] for r in rows if r["max_rel"] is not None), default=float("nan"))
    ok = bool(rows) and not bad
    worlds = sorted({ck.ParallelConfig(**kw).world_size for kw in SHARED_CONFIGS})
    kernels = {k: v for r in rows for k, v in r["ring_kernels"].items()}  # ring attention's CUDA kernel probes
    detail = (f"{len(rows)} runs ({len(SHARED_CONFIGS)} configs on {', '.join(map(str, worlds))} ranks sharing "
              f"{ctx['devices'] if ctx['cuda'] else 'no'} GPU, x {len(OPTIMIZERS)} optimizers) on {device}, every call "
              f"staged; worst rel {_rel(worst)} (<= {RTOL:g}){'; FAILED: ' + '; '.join(bad) if bad else ''}"
              + (f"; ring attention's fused kernels: {kernels}" if kernels else ""))
    return ok, {"rows": rows, "reference": refs, "env": env, "rtol": RTOL, "ring_kernels": kernels}, detail


def _references() -> dict:
    cfg, data = GPTConfig(**PARITY_MODEL), SyntheticTokens(PARITY_MODEL["vocab_size"], PARITY_MODEL["seq_len"], seed=1)
    return {opt: train_single_process(cfg, f, data, PARITY_STEPS, PARITY_BATCH)[0] for opt, f in OPTIMIZERS.items()}


# ------------------------------------------------------------------ 5. the memory timeline from CUDA's allocator log
def _rank_memory_history(tmp: str):
    import pickle
    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4)
    torch.manual_seed(0)
    engine = ck.boost(GPT(cfg), _adamw, ck.ParallelConfig())
    data = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=3)
    engine.train_step(data.batch(0, 8))
    if engine.mesh.device.type != "cuda":  # the CPU smoke: the log is refused with a way out
        try:
            ck.memory_timeline(engine, data.batch(1, 8), method="history")
        except ValueError as exc:
            return {"refused": str(exc)}
        return {"refused": None}
    held = engine.memory()
    path = os.path.join(tmp, "history-rank{rank}.pickle")
    tl = ck.memory_timeline(engine, data.batch(1, 8), snapshot=path)
    stats = torch.cuda.memory_stats()  # requested bytes: the log's unit (peak since the step's reset)
    with open(path.format(rank=0), "rb") as fh:
        snap = pickle.load(fh)
    dispatch = ck.memory_timeline(engine, data.batch(2, 8), method="dispatch")
    out = {"source": tl.source, "samples": len(tl.times), "peak": tl.peak, "step_peak": engine.step_peak,
           "requested_peak": stats["requested_bytes.all.peak"], "end_total": tl.allocator[-1],
           "requested_now": stats["requested_bytes.all.current"], "params_start": tl.held(0)["params"],
           "params_engine": held["params"],
           "activations": max(tl.series["activations"]), "activations_dispatch": max(dispatch.series["activations"]),
           "engine_activations": engine.memory()["activations"], "summary": tl.summary(),
           "snapshot_traces": len(snap.get("device_traces", [[]])[0]), "top": tl.alive_at_peak[:3]}
    engine.close()
    return out


def check_memory_history(ctx):
    """CUDA: the allocator log's timeline (requested bytes) ends at the allocator's requested bytes held and peaks
    at their peak over the step, to the byte, at most the step's max_memory_allocated() (blocks rounded up); its
    params are the engine's to the byte; its activations within 10% of the dispatch meter's; the snapshot
    pickles. CPU: the log is refused."""
    with tempfile.TemporaryDirectory() as tmp:
        r = _launch(ctx, _rank_memory_history, 1, tmp)[0]
    if not ctx["cuda"]:
        ok = r["refused"] is not None and "allocator log" in r["refused"] and "dispatch" in r["refused"]
        return ok, r, f"CPU: method='history' refused: {r['refused']}"
    ok = (r["source"] == "cuda history" and r["end_total"] == r["requested_now"] and r["peak"] == r["requested_peak"]
          and r["peak"] <= r["step_peak"] and r["params_start"] == r["params_engine"]
          and abs(r["activations"] - r["activations_dispatch"]) <= 0.1 * r["activations_dispatch"]
          and r["snapshot_traces"] > 0)
    return ok, r, (f"{r['samples']} samples; peak {r['peak']:,} B requested (the allocator's {r['requested_peak']:,}; "
                   f"blocks {r['step_peak']:,}); end {r['end_total']:,} (the allocator's {r['requested_now']:,}); "
                   f"params {r['params_start']:,} (engine {r['params_engine']:,}); activations {r['activations']:,} "
                   f"(dispatch meter {r['activations_dispatch']:,})")


CHECKS = [("launch", check_launch), ("torchrun", check_torchrun), ("gpt", check_gpt),
          ("zero3_budget", check_zero3_budget), ("parity", check_parity), ("memory_history", check_memory_history),
          ("offload_copies", lambda ctx: check_offload_copies(ctx, _launch)), ("shared_gpu", check_shared_gpu)]
"""In this order: the shared-GPU worlds (up to 60 s each) last, so that a slow one cannot cut the others off
under ``gpu_session.sh``'s timeout."""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="the same checks, tiny, on CPU ranks (gloo under NCCL's rules)")
    ap.add_argument("--out", help="where to write the JSON (default: bench/results/gpu_check.json on CUDA, "
                                  "a temp file with --cpu-smoke)")
    ap.add_argument("--torchrun-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.torchrun_child:
        return _torchrun_child(args.cpu_smoke)
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("gpu_check: no CUDA device here, so nothing to check. Run it on a GPU machine, or run "
              "`python bench/gpu_check.py --cpu-smoke --out FILE` to exercise the same checks on CPU ranks.",
              file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if cuda else 0
    ctx = {"cuda": cuda, "world": gpus if cuda else 2, "devices": gpus if cuda else 1,
           "backend": "nccl" if cuda else "nccl_rules", "sizes": SIZES["cuda" if cuda else "cpu"],
           "timeout": 300.0 if cuda else 120.0, "threads": None if cuda else 1}
    out = args.out or os.path.join(ROOT, "bench", "results", "gpu_check.json")
    if not cuda and not args.out:  # a smoke run never writes over the GPU figures
        fd, out = tempfile.mkstemp(prefix="gpu_check_smoke_", suffix=".json")
        os.close(fd)
    print(f"gpu_check: {f'CUDA, {gpus} GPU(s)' if cuda else 'CPU smoke (nccl_rules)'}, torch {torch.__version__}, "
          f"{ctx['world']} rank(s) for launch/torchrun", flush=True)
    t0 = time.perf_counter()
    results = run_checks(CHECKS, ctx, lambda so_far: _write(out, so_far, cuda, gpus, t0, argv, partial=True))
    report = _write(out, results, cuda, gpus, t0, argv)
    print(f"{'ALL PASS' if report['passed'] else 'SOME FAILED'} in {report['seconds']:.1f} s on {report['device']}; "
          f"figures in {out}")
    return 0 if report["passed"] else 1


def _write(out: str, results: dict, cuda: bool, gpus: int, t0: float, argv, partial: bool = False) -> dict:
    """The result file of the checks run so far (``partial``: more were to come)."""
    # the ranks first: this process makes no CUDA context before the first check has run
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    passed = all(r["status"] == "PASS" for r in results.values()) and not partial
    report = {"mode": "cuda" if cuda else "cpu-smoke", "device": device, "devices": gpus, "torch": torch.__version__,
              "cuda": torch.version.cuda, "nccl": _nccl_version() if cuda else None,
              "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "seconds": round(time.perf_counter() - t0, 2), "passed": passed, "checks": results,
              # the keys every result file has, for bench/report.py (docs/benchmarks.md)
              "benchmark": "gpu_check", "command": " ".join(["python", "bench/gpu_check.py", *(argv or sys.argv[1:])]),
              "when": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(),
              "rows": [row(f"GPU check: {name}", r["status"], None, None, r["detail"]) for name, r in results.items()],
              **({"partial": f"{len(results)} of {len(CHECKS)} checks run so far"} if partial else {})}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".tmp", "w", encoding="utf-8") as fh:  # whole or not at all: a kill mid-write loses no check
        json.dump(report, fh, indent=1, default=str)
    os.replace(out + ".tmp", out)
    return report


if __name__ == "__main__":
    sys.exit(main())
