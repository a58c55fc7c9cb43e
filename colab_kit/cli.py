"""``colab-kit demo``: the headless main job.

Starts local ranks (one per GPU where there are GPUs, else 4 CPU processes) and trains the small GPT
on real text, the Python standard library's own sources read as bytes (``ck.datasets.TextCorpus``,
no download; ``--text PATH`` for any files or directory), with the paper's recipe: AdamW with weight
decay on the matrices only, linear warmup then cosine decay, the global gradient norm clipped at 1.0
(``ck.recipe``). Each rank reads only its dp rows (``engine.loader``). It shows a progress bar, the
loss falling below the text's unigram entropy (what a model that learned only byte frequencies
reaches), the held-out loss, tokens/s and MFU against this machine's measured matmul peak, a sample
of generated text, the memory of every rank; checks the losses against one process running the
same recipe in plain torch; and writes ``demo-report.html`` (device mesh, loss curve, gradient norm
and learning rate, memory per rank, step timeline).

    $ colab-kit demo                    # dp=4 on 4 CPU ranks, 200 steps (about a minute on 2 cores)
    $ colab-kit demo --ranks 2 --steps 10 --report /tmp/r.html
    $ colab-kit demo --config "dp=2 tp=2" --steps 20 --save /tmp/ck   # any ParallelConfig.parse string
    $ colab-kit demo --config "pp=2 dp=2" --steps 20 --resume /tmp/ck # steps 21-40, checked against 40
    $ colab-kit plan --ranks 8 --memory 4MiB --top 10   # ck.plan's table (--constants: the measured ones)

With bf16/fp16 the one-process check is skipped (its yardstick is fp32; mixed precision is held to
its own one-process recipe by ``tests/ranks/test_models_precision.py``).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any
from colab_kit.checkpoint.files import MANIFEST, replace_refusal
from colab_kit.config import Axis
from colab_kit.engine.checks import check_policy
from colab_kit.datasets import TextCorpus
from colab_kit.engine.reference import max_relative_difference
from colab_kit.launch import default_backend
from colab_kit.models import GPT, GPTConfig
from colab_kit.observe.throughput import engine_throughput, format_throughput
from colab_kit.planner import constants
from colab_kit.planner.local.constants import cache_path, cached
from colab_kit.precision import TOLERANCE
import colab_kit as ck

__all__ = ["main", "demo"]

MODEL: dict[str, Any] = dict(vocab_size=256, seq_len=64, d_model=64, n_heads=4, n_layers=2)
"""The demo's GPT: bytes in, bytes out."""
WEIGHT_DECAY, MAX_GRAD_NORM, PROMPT = 0.1, 1.0, "def "


def _corpus(text: str | None):
    """The demo's text, split into train and held-out windows."""
    corpus = TextCorpus.stdlib(MODEL["seq_len"]) if text is None else TextCorpus(text, MODEL["seq_len"])
    return corpus, *corpus.split(0.05)


def _recipe(model, lr: float, total: int):
    return ck.recipe.adamw(model, lr, WEIGHT_DECAY, warmup=min(max(1, total // 10), total - 1), total=total)


def _check_demo(ranks, steps, batch, lr, cfg, save, resume, text) -> None:
    """What every rank would fail at, refused here before any starts: the flag, the rule, a value that works."""
    import torch

    if steps < 1:
        raise ck.ConfigError(f"--steps {steps}: the demo trains at least 1 step (the default is 200)")
    if batch < 1:
        raise ck.ConfigError(f"--batch {batch}: a batch holds at least 1 row per rank (the default is 32)")
    if not (math.isfinite(lr) and lr > 0):
        raise ck.ConfigError(f"--lr {lr}: a learning rate is a number > 0 (the default is 3e-3)")
    texts = [] if text is None else list(text) if isinstance(text, (list, tuple)) else [text]
    for flag, path in [("--resume", resume), *(("--text", t) for t in texts)]:
        if path is not None and not os.path.exists(path):
            raise ck.ConfigError(f"{flag} {path}: no such file or directory")
    if resume is not None and not os.path.isfile(os.path.join(resume, MANIFEST)):
        raise ck.ConfigError(f"--resume {resume}: not a checkpoint colab_kit saved (no {MANIFEST} in it): pass the "
                             "directory a run's --save wrote")
    if save is not None and (why := replace_refusal(os.path.abspath(save))) is not None:
        raise ck.ConfigError(f"--save {save}: {why}")
    with torch.device("meta"):  # the model's rules (heads, layers, vocabulary over the degrees), no memory
        check_policy(GPT(GPTConfig(**MODEL)), cfg)


def _train(config_dict: dict, steps: int, batch: int, lr: float, show_progress: bool, save: str | None = None,
           resume: str | None = None, text: str | None = None):
    """Runs on every rank: boost with the recipe (and load ``resume``), train ``steps`` more steps on this
    rank's rows (and save), evaluate, sample, return what the report needs; ``losses`` are every step's,
    the resumed run's first."""
    import torch.distributed as dist


    cfg = ck.ParallelConfig(**config_dict)
    corpus, train, val = _corpus(text)
    model = GPT(GPTConfig(**MODEL))
    opt, sched = _recipe(model, lr, steps)
    engine = ck.boost(model, opt, cfg, lr_scheduler=sched, max_grad_norm=MAX_GRAD_NORM)
    loader = engine.loader(train, batch, seed=0)
    if resume:
        saved = engine.load(resume).get("demo", {})  # the loader's position and the schedule come back too
        if saved and (saved["lr"], saved["batch"]) != (lr, batch):
            raise ck.ConfigError(f"{resume} was trained with --lr {saved['lr']} --batch {saved['batch']}: pass "
                                 f"the same to continue that run")
    total = sched.lr_lambdas[0].total  # the schedule of the run that started it
    start = engine.step_count
    lead = engine.mesh.global_rank == 0 and show_progress
    bar = None
    if lead:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=f"training ({cfg.describe()})", unit="step", file=sys.stdout,
                   mininterval=0.5)
    every = max(1, steps // 10)  # about ten lines a run (200 steps: every 20th), the bar showing each step's loss
    t0 = time.perf_counter()
    for step in range(start, start + steps):
        loss = engine.train_step(next(loader))
        if bar is not None:
            done = step + 1 - start
            if done == 1 or done % every == 0 or done == steps:
                r = engine.records[-1]
                bar.write(f"step {step + 1:3d}/{start + steps}  loss {loss:.4f}  grad norm {r['grad_norm']:.3f}"
                          f"  lr {r['lr']:.2e}")
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            bar.update(1)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    held_out = engine.evaluate(val_batch(val, batch))
    sample = None
    if cfg.sp == 1:  # generation runs under dp, tp and pp
        prompt = corpus.encode(PROMPT).unsqueeze(0)
        sample = corpus.decode(engine.generate(prompt, 48, temperature=0.8, seed=0)[0])
    dist.barrier()
    speed = engine_throughput(engine) if engine.mesh.global_rank == 0 else None  # one rank measures the peak, alone
    dist.barrier()
    if save:
        engine.save(save, extra={"demo": {"lr": lr, "batch": batch}})
    return {"losses": list(engine.history), "start": start, "memory": engine.memory(), "timeline": engine.timeline(),
            "comm_bytes_per_step": sum(r["bytes"] for r in engine.comm(last_step=True)),
            "seconds": seconds, "records": list(engine.records), "total": total, "held_out": held_out,
            "sample": sample, "throughput": speed, "unigram": corpus.unigram_entropy()}


def val_batch(val, batch: int):
    """The held-out batch: the first ``batch`` windows of the held-out split (the same on every rank)."""
    import torch
    items = [val[i] for i in range(min(batch, len(val)))]
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def _single_process(steps: int, batch: int, lr: float, total: int, text: str | None = None,
                    pieces: int = 1) -> list[float]:
    """The recipe in one process, plain torch, on the same global batches, accumulated over ``pieces``
    (dp x microbatches: the engine's order of summing the rows, ``recipe.one_process``)."""
    _, train, _ = _corpus(text)
    model = GPT(GPTConfig(**MODEL))
    loader = ck.datasets.ShardedLoader(train, batch, dp_size=1, dp_rank=0, seed=0)
    return ck.recipe.one_process(model, lambda m: _recipe(m, lr, total), lambda s: next(loader), steps,
                                 MAX_GRAD_NORM, pieces=pieces)["losses"]


def write_report(path: str, cfg, results: list[dict], reference: list[float] | None) -> None:
    from colab_kit import viz

    figs = [viz.mesh_figure(cfg, axis=_mesh_axis(cfg)),
            viz.loss_figure(results[0]["losses"], reference=reference,
                            title=f"Training loss, {cfg.describe()} (measured)"),
            viz.recipe_figure(results[0]["records"], MAX_GRAD_NORM, [r["lr"] for r in results[0]["records"]]),
            viz.memory_figure([r["memory"] for r in results]),
            viz.timeline_figure([r["timeline"] for r in results])]
    parts = [f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs)]
    html = ("<!doctype html><html><head><meta charset='utf-8'><title>colab_kit demo</title></head>"
            "<body style='font-family:sans-serif;max-width:1000px;margin:auto'>"
            f"<h1>colab_kit demo: {cfg.describe()}</h1><p>Every figure shows data recorded by the engine "
            "during this run; the dashed loss line is one process training the same model.</p>"
            + "".join(parts) + "</body></html>")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(html)


def _mesh_axis(cfg) -> str:
    """The axis the report's mesh is coloured by: tp, else pp, else sp, else dp (the groups that talk most)."""
    return next((a for a in (Axis.TP, Axis.PP, Axis.SP) if getattr(cfg, a) > 1), Axis.DP)


def tolerance(cfg) -> float:
    """The contract's relative loss tolerance: 1e-5 in fp32, ``precision.TOLERANCE`` for bf16/fp16."""
    return 1e-5 if cfg.precision == "fp32" else TOLERANCE[cfg.precision]


def demo(ranks: int | None = None, steps: int = 200, batch: int = 32, lr: float = 3e-3,
         report: str = "demo-report.html", check: bool = True, out=None, config: str | None = None,
         save: str | None = None, resume: str | None = None, text: str | None = None) -> dict:
    """Train the demo GPT under ``config`` (a ``ParallelConfig.parse`` string; default dp over ``ranks``),
    ``steps`` steps (after the saved ones with ``resume``) on ``text`` (files or a directory; default the
    standard library's sources), save at the end with ``save``."""
    import torch

    out = out or sys.stdout

    if config is not None:
        cfg = ck.ParallelConfig.parse(config)
        if ranks is not None and ranks != cfg.world_size:
            raise ck.ConfigError(f"--config {config!r} runs on {cfg.world_size} ranks, not --ranks {ranks}: "
                                 f"drop --ranks, or pick degrees whose product is {ranks}")
        ranks = cfg.world_size
    if ranks is None:
        ranks = torch.cuda.device_count() or 4
    if ranks < 1:
        raise ck.ConfigError(f"--ranks {ranks}: the demo runs on at least 1 rank (--ranks 1, or leave it out)")
    if config is None:
        cfg = ck.ParallelConfig(dp=ranks)
    _check_demo(ranks, steps, batch, lr, cfg, save, resume, text)
    if batch % (cfg.dp * cfg.microbatches):
        m = cfg.dp * cfg.microbatches
        what = f"{ranks} ranks" if config is None else f"dp={cfg.dp} x microbatches={cfg.microbatches}"
        raise ck.ConfigError(f"--batch {batch} does not split over {what}: use a multiple of {m}")
    print(f"colab_kit demo: GPT {MODEL} on {ranks} local rank(s), {cfg.describe()}, "
          f"backend {default_backend(ranks)}", file=out)
    t0 = time.perf_counter()
    results = ck.launch(_train, ranks, cfg.to_dict(), steps, batch, lr, True, save, resume, text)
    wall = time.perf_counter() - t0
    first = results[0]
    start = first["start"]
    resumed = f" after the {start} steps of {resume}" if resume else ""
    print(f"\n{steps} steps{resumed} in {first['seconds']:.2f} s of training ({wall:.2f} s with process "
          f"start); loss {first['losses'][start]:.4f} -> {first['losses'][-1]:.4f}, held out "
          f"{first['held_out']:.4f}; the text's unigram entropy is {first['unigram']:.4f} nats per byte "
          f"({'below it' if first['losses'][-1] < first['unigram'] else 'not below it yet: train longer'})", file=out)
    print(f"throughput: {format_throughput(first['throughput'])}", file=out)
    print(f"bytes sent to collectives per step by rank 0: {first['comm_bytes_per_step']:,}", file=out)
    if first["sample"] is not None:
        print(f"sample (temperature 0.8) after {PROMPT!r}: {first['sample']!r}", file=out)
    if save:
        print(f"checkpoint of step {start + steps} saved to {save} (resume it under any config: --resume)", file=out)
    print("\nmemory per rank (bytes, measured):", file=out)
    keys = [k for k, v in results[0]["memory"].items() if isinstance(v, int)]  # totals (not the by-place dicts)
    print("rank  " + "  ".join(f"{k:>12}" for k in keys), file=out)
    for r, res in enumerate(results):
        print(f"{r:4d}  " + "  ".join(f"{res['memory'][k]:>12,}" for k in keys), file=out)
    reference = None
    if check and cfg.precision != "fp32":
        print(f"\nthe one-process check is fp32's: skipped for {cfg.precision} "
              "(see tests/ranks/test_models_precision.py)", file=out)
    elif check:
        reference = _single_process(start + steps, batch, lr, first["total"], text, cfg.dp * cfg.microbatches)
        worst = max_relative_difference(results[0]["losses"], reference)
        verdict = "OK" if worst <= tolerance(cfg) else "MISMATCH"
        pieces = cfg.dp * cfg.microbatches
        summed = f", summing each batch's gradient over the same {pieces} row pieces" if pieces > 1 else ""
        print(f"\nagainst one process training the same model for all {start + steps} steps{summed}: max relative "
              f"loss difference {worst:.2e} ({verdict}, contract "
              f"{'1e-5' if cfg.precision == 'fp32' else f'{tolerance(cfg):.2g}'})",
              file=out)
    if report:
        write_report(report, cfg, results, reference)
        print(f"report written to {report}", file=out)
    return {"results": results, "reference": reference, "config": cfg}


PLAN_MODELS: dict[str, dict[str, Any]] = {
    "small": MODEL, "medium": dict(vocab_size=256, seq_len=64, d_model=128, n_heads=8, n_layers=8),
    "gpt3-175b": dict(vocab_size=51200, seq_len=2048, d_model=12288, n_heads=96, n_layers=96),
    "megatron-1t": dict(vocab_size=51200, seq_len=2048, d_model=25600, n_heads=160, n_layers=128)}
"""Models ``colab-kit plan --model`` knows: "small" is the demo's GPT; the last two are for ``--hardware``
(``colab-kit plan --model gpt3-175b --ranks 1536 --batch 1536 --precision fp16 --hardware 8xA100-80GB``)."""


def _bytes(text: str) -> int:
    """``--memory``: bytes, or a number with KiB / MiB / GiB (``512MiB``, ``1.5 GiB``)."""
    t = text.strip().replace(" ", "")
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1)):
        if t.lower().endswith(unit.lower()):
            return int(float(t[: -len(unit)]) * k)
    return int(t)


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="rank parallel configurations by estimated memory and step time (ck.plan)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--model", choices=sorted(PLAN_MODELS), default="small")
    p.add_argument("--batch", type=int, default=32, help="global batch size (rows)")
    p.add_argument("--memory", type=_bytes, default=None, help="device bytes per rank (e.g. 64MiB)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--constants", action="store_true", help="print the measured constants too")
    p.add_argument("--refresh", action="store_true", help="measure the constants again")
    p.add_argument("--hardware", default=None,
                   help="plan on a cluster preset instead of this machine (the at-scale cost model calibrated on "
                        "Megatron-LM's Table 1, docs/estimate.md): 8xA100-80GB, 8xH100-SXM, 8xH100-96GB-500W, "
                        "8xH200-SXM or 8xH800-SXM; any number of ranks, nothing measured")


def plan_command(args, out=None) -> int:
    import json



    out = out or sys.stdout
    try:
        # this machine's constants, measured with as many local processes as ranks: only where ck.plan would
        # measure them itself (1-16 ranks, no preset); otherwise ck.plan says what to pass, before anything starts
        if args.hardware is not None and args.refresh:
            raise ck.ConfigError("--refresh measures this machine's constants and --hardware prices a node preset "
                                 "instead: give one of them")
        here = args.hardware is None and 1 <= args.ranks <= 16
        if here and (args.refresh or cached(args.ranks) is None):
            print(f"colab-kit plan: measuring this machine's constants on {args.ranks} local processes "
                  f"(seconds; cached in {cache_path()} for the next runs)", file=sys.stderr, flush=True)
        consts = constants(refresh=args.refresh, ranks=args.ranks) if here else None
        cands = ck.plan(GPTConfig(**PLAN_MODELS[args.model]), args.ranks, args.batch, args.memory, args.precision,
                        constants=consts, hardware=args.hardware)
    except ck.ConfigError as exc:
        hint = " (here: --hardware NAME)" if args.hardware is None and args.ranks > 16 else ""
        print(f"colab-kit plan: {exc}{hint}", file=sys.stderr)
        return 2
    where = f" on {args.hardware} nodes (planned: the at-scale cost model, docs/estimate.md)" if args.hardware else ""
    print(f"colab_kit plan: GPT {PLAN_MODELS[args.model]} on {args.ranks} ranks{where}, batch {args.batch}", file=out)
    print(cands.table(args.top), file=out)
    if args.constants:
        print(json.dumps(cands.constants, indent=1, sort_keys=True), file=out)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="colab-kit", description="colab_kit command line")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train the small GPT on local ranks (data parallel, or any --config)")
    d.add_argument("--ranks", type=int, default=None, help="local ranks (default: one per GPU, else 4)")
    d.add_argument("--config", default=None, help='parallel config, e.g. "dp=2 tp=2" (default: dp over the ranks)')
    d.add_argument("--save", default=None, metavar="PATH", help="save a checkpoint at the end")
    d.add_argument("--resume", default=None, metavar="PATH", help="continue a saved run (any config)")
    d.add_argument("--steps", type=int, default=200)
    d.add_argument("--text", default=None, metavar="PATH",
                   help="text files or a directory to train on (default: the Python standard library's sources)")
    d.add_argument("--batch", type=int, default=32, help="global batch size (rows)")
    d.add_argument("--lr", type=float, default=3e-3)
    d.add_argument("--report", default="demo-report.html", help="HTML report path ('' for none)")
    d.add_argument("--no-check", action="store_true", help="skip the single-process comparison")
    add_plan_parser(sub)
    args = parser.parse_args(argv)

    if args.command == "plan":
        return plan_command(args)

    try:
        result = demo(args.ranks, args.steps, args.batch, args.lr, args.report, not args.no_check,
                      config=args.config, save=args.save, resume=args.resume, text=args.text)
    except (ck.ConfigError, ck.RankError) as exc:
        print(f"colab-kit demo: {exc}", file=sys.stderr)
        return 2
    if result["reference"] is not None:
        worst = max_relative_difference(result["results"][0]["losses"], result["reference"])
        return 0 if worst <= tolerance(result["config"]) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
