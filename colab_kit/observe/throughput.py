"""Throughput of a training job: tokens per second, FLOPs per step, achieved FLOP/s and MFU.

Three pieces, each usable alone:

- ``model_flops(model_or_cfg, batch_shape)``: the matmul FLOPs of one training step of the dense
  model on a global batch of that shape (``training=False``: the forward alone);
- ``peak_matmul_flops()``: the best matmul rate this machine reaches, measured once (MAMF-style) and
  cached as JSON beside the planner's constants (``$COLAB_KIT_CACHE``);
- ``engine_throughput(engine)`` (also ``ck.throughput(engine)``): the two above applied to the steps
  the engine recorded, and ``format_throughput(d)``, its one-line summary.

**The formula.** Only matrix products are counted (what ``torch.utils.flop_counter.FlopCounterMode``
counts: mm, addmm, bmm, convolutions and attention kernels; LayerNorm, GELU, softmax and the
embedding look-ups are left out, as it leaves them out). A Linear of ``i`` inputs and ``o``
outputs on ``n`` rows costs ``2 n i o`` forward; its backward costs the same again for the weight's
gradient and again for the input's, except for a layer whose input needs no gradient (ViT's patch
embedding on the images), where autograd skips it. Attention on ``b`` sequences of ``t`` tokens,
width ``h`` (all heads), costs ``2 b t^2 h`` for ``Q K^T`` and as much for ``P V``, the full square
also when causal (the kernel computes all of it). The built-ins call
``F.scaled_dot_product_attention``, whose fused kernels recompute the scores in backward: torch
counts that backward as five products of the forward's size (``sdpa_backward_flop_count``), so
attention trains at 3.5x its forward, everything else at 3x (2x for the input layer). Per GPT block
(``f = d_ff``) with ``n = b t``::

    forward  = 2 n (3h^2 + h^2 + h f + f h)   qkv, proj, fc1, fc2
             + 4 b t^2 h                      Q K^T and P V
    training = 3 x the Linears + 3.5 x the attention

plus the LM head ``2 n h V`` (x3); BERT adds its MLM transform ``2 n h^2`` (x3); ViT runs its blocks
on ``t = patches + 1`` tokens, the patch Linear ``2 b patches (c p^2) h`` (x2) and its head on the
class token only, ``2 b h classes`` (x3).

Worked example, ``GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2)`` on a
batch ``[8, 32]``: ``n = 256``, each block's Linears hold ``4*64^2 + 2*64*256 = 49,152`` weights, the
head ``4,096``, so the Linears' forward is ``2 * 256 * (2 * 49,152 + 4,096) = 52,428,800``; attention
is ``2 * 4 * 8 * 32^2 * 64 = 4,194,304``. Training: ``3 * 52,428,800 + 3.5 * 4,194,304 = 171,966,464``::

    >>> from colab_kit.models import GPTConfig
    >>> g = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2)
    >>> model_flops(g, (8, 32), training=False), model_flops(g, (8, 32))
    (56623104, 171966464)

Any other ``nn.Module`` (a Hugging Face GPT-2, a user's MLP) is traced instead: one forward and
backward with fake tensors (``FakeTensorMode``: shapes only, nothing computed) under
``flop_counter()``, the CPU kernels' choices included (GPT-2 training with attention dropout takes the
unfused path: plain bmm's, backward 2x). Both paths equal ``FlopCounterMode`` measuring the real step
for GPT, BERT, ViT, GPT-2 and an MLP (``tests/ranks/test_throughput.py`` asks for 2%).

This is torch's count of what runs, which differs a little from the "model FLOPs" of MFU papers
(PaLM's ``6N + 12 L h t`` per token: every backward 2x): attention's recomputed scores add 1/7 of its
share and the input layer's skipped gradient takes some away. For the example above a flat 3x gives
``169,869,312``, 1.2% less.

``flop_counter()`` is ``FlopCounterMode`` with the CPU attention kernel
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward) given torch's own SDPA formulas: in
torch 2.13 only the CUDA kernels have them, and on CPU the attention counted as zero.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import weakref
import time

import torch

from .measured import cache_path
from ..models import BERT, BERTConfig, GPT, GPTConfig, ViT, ViTConfig
from ..precision import compute_dtype
from ..sharded_init import meta_twin

__all__ = ["engine_throughput", "flop_counter", "format_throughput", "model_flops", "peak_matmul",
           "peak_matmul_flops"]

_FLOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per engine, the FLOPs of a step per global input shape (a trace each: kept while the engine lives)."""


# ------------------------------------------------------------------ FLOPs of a step
def flop_counter(**kwargs):
    """``FlopCounterMode(display=False, **kwargs)`` that also counts the CPU SDPA kernel (see the module)."""
    from torch.utils import flop_counter as fc
    aten = torch.ops.aten

    def fwd(q, k, v, *a, out_shape=None, **kw):
        return fc.sdpa_flop_count(q, k, v)

    def bwd(g, q, k, v, *a, out_shape=None, **kw):
        return fc.sdpa_backward_flop_count(g, q, k, v)

    mapping = {aten._scaled_dot_product_flash_attention_for_cpu: fwd,
               aten._scaled_dot_product_flash_attention_for_cpu_backward: bwd, **kwargs.pop("custom_mapping", {})}
    kwargs.setdefault("display", False)
    return fc.FlopCounterMode(custom_mapping=mapping, **kwargs)


def model_flops(model_or_cfg, batch_shape, *, training: bool = True, dtype: torch.dtype | None = None) -> int:
    """Matmul FLOPs of one step (forward and backward; ``training=False``: forward only) of the dense
    model on a global batch of ``batch_shape`` (``[b, t]`` token ids, ``[b, c, H, W]`` images for ViT).

    ``model_or_cfg``: a ``GPTConfig`` / ``BERTConfig`` / ``ViTConfig`` or such a model (the analytic
    formula of the module docstring), or any ``nn.Module``, real or on the meta device (traced with fake
    tensors; ``dtype`` of its input: int64 for ``[b, t]`` into a model with an ``nn.Embedding``, else
    float32). ``model_flops(GPTConfig(...), (8, 32))`` -> 171,966,464 for the module's example.
    """
    shape = tuple(int(s) for s in batch_shape)
    cfg = _builtin_cfg(model_or_cfg)
    if cfg is not None:
        first, linears, attention = _terms(cfg, shape)
        if not training:
            return first + linears + attention
        return 2 * first + 3 * linears + attention * 7 // 2  # attention: 4 b t^2 h, a multiple of 2
    if not isinstance(model_or_cfg, torch.nn.Module):
        raise TypeError(f"model_flops takes a GPTConfig, BERTConfig, ViTConfig or an nn.Module, "
                        f"got {type(model_or_cfg).__name__}")
    return _traced(model_or_cfg, shape, training, dtype)


def _builtin_cfg(obj) -> GPTConfig | BERTConfig | ViTConfig | None:
    """The config of a built-in model (or the config itself); None for another model (a subclass included)."""
    if isinstance(obj, (GPTConfig, BERTConfig, ViTConfig)):
        return obj
    if isinstance(obj, (GPT, BERT, ViT)) and type(obj) in (GPT, BERT, ViT):
        return obj.cfg
    return None


def _terms(cfg, shape) -> tuple[int, int, int]:
    """Forward FLOPs of a built-in model: (the Linear on the raw input, the other Linears, attention)."""
    h, layers, f = cfg.d_model, cfg.n_layers, cfg.d_ff
    block = 4 * h * h + 2 * h * f  # weights of qkv (3h^2), proj (h^2), fc1 and fc2 (h f each)
    if isinstance(cfg, ViTConfig):
        if len(shape) != 4:
            raise ValueError(f"a ViT's batch is images [b, c, H, W], got the shape {list(shape)}")
        b, c, hh, ww = shape
        p = cfg.patch_size
        patches = (hh // p) * (ww // p)
        t = patches + 1  # and the class token
        first = 2 * b * patches * (c * p * p) * h
        linears = 2 * b * t * layers * block + 2 * b * h * cfg.num_classes  # the head: class token only
    else:
        if len(shape) != 2:
            raise ValueError(f"a {type(cfg).__name__[:-6]}'s batch is token ids [b, t], got the shape {list(shape)}")
        b, t = shape
        tail = h * cfg.vocab_size + (h * h if isinstance(cfg, BERTConfig) else 0)  # head (+ BERT's MLM dense)
        first, linears = 0, 2 * b * t * (layers * block + tail)
    return first, linears, layers * 4 * b * t * t * h


def _traced(model: torch.nn.Module, shape: tuple, training: bool, dtype) -> int:
    """One forward (and backward) of ``model`` on fake tensors of ``shape`` under ``flop_counter()``."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    twin = meta_twin(model)  # a meta copy: the caller's model keeps its mode and storage
    twin.train(training)
    if dtype is None:
        ids = len(shape) == 2 and any(isinstance(m, torch.nn.Embedding) for m in twin.modules())
        dtype = torch.int64 if ids else torch.float32
    mode = FakeTensorMode()
    with mode:
        params = {n: torch.empty(p.shape, dtype=p.dtype, requires_grad=p.requires_grad and training)
                  for n, p in twin.named_parameters()}
        bufs = {n: torch.zeros(b.shape, dtype=b.dtype) for n, b in twin.named_buffers()}
        x = torch.zeros(shape, dtype=dtype)
    counter = flop_counter()
    try:
        with mode, counter, torch.set_grad_enabled(training):
            out = _first_tensor(functional_call(twin, {**params, **bufs}, (x,), strict=False))
            if training and out.requires_grad:
                out.float().sum().backward()
    except Exception as exc:
        raise ValueError(f"model_flops could not trace {type(model).__name__} on a fake input of shape "
                         f"{list(shape)} ({dtype}): {type(exc).__name__}: {exc}") from exc
    return int(counter.get_total_flops())


def _first_tensor(out):
    """The logits of what a forward returned: a tensor, ``.logits`` (Hugging Face), or the first tensor."""
    if isinstance(out, torch.Tensor):
        return out
    if getattr(out, "logits", None) is not None:
        return out.logits
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for item in items:
        if isinstance(item, torch.Tensor):
            return item
    raise TypeError(f"the model's forward returned {type(out).__name__}, with no tensor to take as its output")


# ------------------------------------------------------------------ the machine's peak
_SHAPES = {  # (M, N, K) of M x K @ K x N, likeliest winners first (a time budget may cut the list)
    "cpu": [(1024, 1024, 1024), (2048, 2048, 2048), (512, 512, 512), (2048, 1024, 1024), (1024, 2048, 1024),
            (1024, 1024, 2048), (2048, 2048, 512), (2048, 512, 2048), (512, 2048, 2048), (256, 256, 256)],
    "cuda": [(4096, 4096, 4096), (8192, 8192, 8192), (2048, 2048, 2048), (16384, 8192, 4096),
             (8192, 16384, 4096), (4096, 8192, 16384), (8192, 8192, 4096), (1024, 1024, 1024)],
}
_BUDGET_S = {"cpu": 2.5, "cuda": 10.0}  # seconds after which no new shape is started
_REPEATS = {"cpu": (1, 3), "cuda": (5, 10)}  # (warmup, timed) runs of each shape
_MEMO: dict = {}  # (cache file, key) -> the entry: no JSON read per call


def _peak_path() -> str:
    root = os.path.dirname(cache_path())
    return os.path.join(root, f"matmul-peak-{platform.node() or 'host'}-{torch.__version__.split('+')[0]}.json")


def peak_matmul(device=None, dtype: torch.dtype = torch.float32, refresh: bool = False,
                threads: int | None = None) -> dict:
    """``peak_matmul_flops``'s measurement: ``{"flops_per_s", "shape" [M, N, K], "device", "dtype",
    "threads", "host", "torch", "seconds_to_measure", "shapes_timed"}``, cached (see there)."""
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    cpu = device.type == "cpu"
    threads = int(threads or torch.get_num_threads())
    kind = "cpu" if cpu else (torch.cuda.get_device_name(device) if device.type == "cuda" else device.type)
    key = f"{kind}|{str(dtype).replace('torch.', '')}" + (f"|threads={threads}" if cpu else "")
    if not cpu and dtype == torch.float32:  # TF32 or not: torch.set_float32_matmul_precision
        key += f"|fp32={torch.get_float32_matmul_precision()}"
    path = _peak_path()
    if not refresh and (path, key) in _MEMO:
        return _MEMO[path, key]
    cached = {}
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as fh:
                cached = json.load(fh)
        except (OSError, ValueError):
            cached = {}
    if refresh or key not in cached:
        before = torch.get_num_threads()
        if cpu:
            torch.set_num_threads(threads)
        try:
            entry = _measure(device, dtype)
        finally:
            torch.set_num_threads(before)
        cached[key] = {**entry, "device": kind, "dtype": str(dtype).replace("torch.", ""), "threads": threads,
                       "host": platform.node() or "host", "torch": torch.__version__}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + f".{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(cached, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)  # ranks measuring at once: each write is whole
    _MEMO[path, key] = cached[key]
    return cached[key]


def peak_matmul_flops(device=None, dtype: torch.dtype = torch.float32, refresh: bool = False,
                      threads: int | None = None) -> float:
    """The best matmul FLOP/s this machine reaches on ``device`` (default: CUDA if there is one, else the
    CPU) in ``dtype``, with ``threads`` CPU threads (default ``torch.get_num_threads()``: what a rank
    uses), measured once and cached.

    MAMF-style (Stas Bekman's "maximum achievable matmul FLOPS" finder): a few square and rectangular
    ``M x K @ K x N`` shapes (M, N, K from 256 to 2048 on CPU, 1024 to 16384 on CUDA, synchronised), each
    run a few times after a warmup; a shape achieves ``2 M N K / (its fastest run's seconds)`` (another
    process on the cores only ever slows a run down), the peak is the best shape's. About 3 s at most on
    CPU: a shape that would end past 2.5 s at the best rate so far is skipped. Cached in ``$COLAB_KIT_CACHE``
    (``~/.cache/colab_kit``) as ``matmul-peak-<host>-<torch>.json``, one entry per device kind, dtype and
    (CPU) thread count (on a GPU, for fp32, ``torch.get_float32_matmul_precision()``: TF32 or not), with the
    winning shape (``peak_matmul``); ``refresh=True`` measures again.
    Here (2 cores shared with other work), one thread, fp32: about 1.9e11 FLOP/s, in 1.6-1.7 s.
    """
    return float(peak_matmul(device, dtype, refresh, threads)["flops_per_s"])


def _measure(device: torch.device, dtype: torch.dtype) -> dict:
    kind = "cpu" if device.type == "cpu" else "cuda"
    sync = {"cuda": torch.cuda.synchronize, "mps": getattr(torch, "mps", None) and torch.mps.synchronize}.get(
        device.type) or (lambda: None)
    warmup, reps = _REPEATS[kind]
    t0 = time.perf_counter()
    best: tuple[float, list[int] | None] = (0.0, None)  # (FLOP/s, its shape)
    timed = 0
    for m, n, k in _SHAPES[kind]:
        runs = warmup + reps
        if timed and time.perf_counter() - t0 + runs * 2 * m * n * k / best[0] > _BUDGET_S[kind]:
            continue  # would overrun the budget at the best rate so far: try the smaller ones left
        a, b = torch.randn(m, k, device=device).to(dtype), torch.randn(k, n, device=device).to(dtype)
        for _ in range(warmup):
            a @ b
        sync()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            sync()
            times.append(time.perf_counter() - t)
        rate = 2 * m * n * k / min(times)  # a matmul never runs faster than the machine: the best run is its rate
        timed += 1
        if rate > best[0]:
            best = (rate, [m, n, k])
        del a, b
    return {"flops_per_s": best[0], "shape": best[1], "shapes_timed": timed,
            "seconds_to_measure": round(time.perf_counter() - t0, 3)}


# ------------------------------------------------------------------ an engine's steps
def engine_throughput(engine, last: int | None = None) -> dict:
    """Throughput of ``engine``'s recorded steps on this rank (``ck.throughput(engine)``).

    The steps: the last ``last`` records, or all but the first when there are two or more (the first
    step builds caches and buckets). Returns::

        steps           records used             step_seconds    their median wall time on this rank
        input_shape     the global batch's       tokens_per_step b*t (tokens), b*patches (ViT), else None
        tokens_per_s    tokens / step_seconds    samples_per_s   b / step_seconds
        flops_per_step  model_flops of the dense model (engine.model_cfg, else its meta copy engine.dense_twin)
        achieved_flops  flops_per_step / step_seconds: the whole job's FLOP/s
        world_size      ranks                    flops_per_rank  achieved_flops / world_size
        peak_flops      peak_matmul_flops of one rank (its device, compute dtype and thread count)
        peak_shape      the matmul that reached it               mfu  flops_per_rank / peak_flops

    On CPU the ranks share the machine's cores (``ck.launch`` gives each ``cores / ranks`` threads),
    so MFU is one rank's share of the job against what one rank's threads reach alone. With shapes
    that vary between steps, the per-step tokens and FLOPs are the mean over the steps used.
    Worked example: dp=2, GPT of the module's example, batch [8, 32] at 20 ms a step: 12,800 tokens/s,
    8.6 GFLOP/s for the job, 4.3 per rank; against a peak of 180 GFLOP/s, MFU 2.4%.
    """
    records = list(engine.records)
    if not records:
        raise ValueError("ck.throughput(engine) has no steps to measure yet: run engine.train_step(batch) first")
    lacking = [r.get("step", i + 1) for i, r in enumerate(records) if "seconds" not in r or "input_shape" not in r]
    if lacking:
        raise ValueError(f"engine.records of steps {lacking[:5]} have no 'seconds' or 'input_shape' (an engine "
                         "from before colab_kit.observe.throughput): train with this version to measure throughput")
    if last is not None:
        if isinstance(last, bool) or not isinstance(last, int) or last < 1:
            raise ValueError(f"last must be a positive number of steps, got {last!r}")
        records = records[-last:]
    elif len(records) >= 2:
        records = records[1:]
    seconds = statistics.median(r["seconds"] for r in records)
    try:
        cache = _FLOPS.setdefault(engine, {})  # shape -> FLOPs: one trace per shape and engine
    except TypeError:  # an object that cannot be weakly referenced (a stand-in engine): no cache
        cache = {}
    dtype = engine.step.records.input[1] if engine.step.records.input is not None else None
    flops, tokens, samples = [], [], []
    for r in records:
        shape = tuple(r["input_shape"])
        if shape not in cache:
            model = engine.model_cfg if _builtin_cfg(engine.model_cfg) is not None else engine.dense_twin
            cache[shape] = model_flops(model, shape, dtype=dtype)
        flops.append(cache[shape])
        tokens.append(_tokens(engine.model_cfg, shape, dtype))
        samples.append(shape[0])

    def mean(xs):  # ints when every step's shape is the same
        return xs[0] if len(set(xs)) == 1 else statistics.fmean(xs)

    per_step = mean(flops)
    tok = None if None in tokens else mean(tokens)
    world = engine.config.world_size
    peak = peak_matmul(engine.mesh.device, compute_dtype(engine.config.precision))
    achieved = per_step / seconds
    return {"steps": len(records), "step_seconds": seconds, "input_shape": tuple(records[-1]["input_shape"]),
            "tokens_per_step": tok, "tokens_per_s": None if tok is None else tok / seconds,
            "samples_per_s": mean(samples) / seconds, "flops_per_step": per_step,
            "achieved_flops": achieved, "world_size": world, "flops_per_rank": achieved / world,
            "peak_flops": float(peak["flops_per_s"]), "peak_shape": peak["shape"],
            "mfu": achieved / world / peak["flops_per_s"]}


def _tokens(cfg, shape: tuple, dtype) -> int | None:
    """Tokens of one global batch: b*t for token ids, b*patches for a ViT's images, else None."""
    if isinstance(cfg, ViTConfig):
        return shape[0] * (shape[2] // cfg.patch_size) * (shape[3] // cfg.patch_size)
    if len(shape) == 2 and (dtype is None or not dtype.is_floating_point):
        return shape[0] * shape[1]
    return None


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def format_throughput(d: dict) -> str:
    """One line: ``"12,800 tokens/s · 172 MFLOP/step · MFU 2.4% of 180 GFLOP/s measured peak"`` (samples/s
    as well for images, and instead of tokens/s for inputs that are not tokens)."""
    rate = f"{d['samples_per_s']:,.1f} samples/s"
    if d.get("tokens_per_s") is not None:
        rate = f"{d['tokens_per_s']:,.0f} tokens/s" + (f" ({rate})" if len(d.get("input_shape", ())) == 4 else "")
    return (f"{rate} · {_si(d['flops_per_step'], 'FLOP/step')} · MFU {100 * d['mfu']:.1f}% of "
            f"{_si(d['peak_flops'], 'FLOP/s')} measured peak")
