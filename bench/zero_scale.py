"""The largest GPT that starts and trains under a fixed budget of bytes per rank: colab_kit ZeRO-3 against FSDP2.

One run, ``dp=4`` local ranks, three sides, each given the same model built on the meta device (no rank ever
holds the whole model) and the same budget ``B`` bytes per rank:

    zero3       ck.boost(GPT(cfg, device="meta"), adamw, ParallelConfig(dp=4, zero=3))
    zero3-auto  the same with offload="auto" and boost(..., device_budget=B)
    fsdp2       FSDP2 as its docs build a meta model: fully_shard(block) for every block, then fully_shard(root)
                (reshard_after_forward=True); model.to_empty(device="cpu"); then each parameter's value
                re-made, one parameter at a time: its full value from GPT.init_parameter(name, torch.empty(shape))
                (the values colab_kit's sharded init writes), cut with distribute_tensor(full, mesh, placements,
                src_data_rank=None) (no communication: every rank made the same full value) and copied into
                the local shard; AdamW over the DTensor parameters

Every side steps ``bench/_zero_peers.adamw`` (AdamW, foreach) on the same batches. Per size and side, on each
rank: the start-up peak (how far the process's peak resident memory, ``VmHWM`` after writing "5" to
``/proc/self/clear_refs``, rose above where it was, during the build: ``tests/ranks/test_zero3_meta.py``'s
measure; the process groups are made beforehand and not counted), two timed training steps, then one more step
for the in-step peak: zero3 and fsdp2 under ``colab_kit.memory.peak.StatePeak`` (the model-state bytes at once
inside the step, one instrument on both sides, activations not counted); zero3-auto the device side only, the
placement account's peak over the three steps (``engine.data_parallel.placement.account.peak``: it counts the
activations and staged shards too, so it is the stricter figure). Held: params + grads + optimizer after the
steps (zero3-auto: device and host split as ``engine.memory()`` reports them).

A size fits when the rank with the most stays within ``B`` at both moments: ``max(start-up peak, in-step peak)
<= B``. The two are not added: the start-up peak already holds the shards that the step's peak holds again,
and ``offload="auto"`` fills the budget with chunks by design (adding would refuse it at every size). The sum
is recorded beside (``sum_fits``) for whoever wants that stricter rule. A budget too small for one step of
``offload="auto"`` is refused with a ``ck.ConfigError`` before the step: "refused". The search walks one
ladder of depths (``--layers``, d_model fixed) upwards, each side until its first size that does not fit.
Losses: finite on every side, and at the largest depth that zero3 and fsdp2 both fit, their losses equal
within 1e-5 relative (one GPT init, one data stream).

Worked example of what one rank holds (arithmetic, not a result), fp32, AdamW, N = 4 ranks, the default GPT
(d 256, vocab 1024, seq 32) at 4 layers: Psi = 4 x 789,760 (a block) + 270,336 (token and position tables) +
262,656 (ln_f and the head) = 3,692,032 parameters.

    zero3 after boost        8 Psi / N = 7,384,064 B (shard + gradient piece) + 1,048,576 B (one dense tensor
                             being cut: the token table, the head or fc1): ck.memory.startup_bytes, 8,432,640 B
    fsdp2 after the build    4 Psi / N = 3,692,032 B (its shards; gradients come at the first backward)
                             + the one full tensor being cut
    held after a step        16 Psi / N = 14,768,128 B + step counters, on both sides (zero3-auto: device + host)
    inside a step, beside    zero3: two blocks whole (2 x 3,159,040 B), or a block and the embeddings or the
    what is held             tail, never the embeddings and the tail together (ck.memory.gathered_bytes);
                             fsdp2: its root unit (tables, ln_f and head: 2,131,968 B) is gathered as one,
                             and its all-gather and reduce-scatter buffers; StatePeak measures both
    zero3-auto               the device keeps the gathered units, the activations and the chunks that fit,
                             so its limit is the start-up: 8 Psi / N + 1,048,576 B <= B

On a machine without a GPU the device is an account over host memory (``colab_kit.zero.offload``), while the
start-up is host memory measured: zero3-auto's start-up counts all of it against ``B`` (on a GPU its pieces
are made on the device, then placed). The start-up figure moves by about a MiB between runs (the allocator's
pages); the in-step peaks are exact.

    python bench/zero_scale.py                                  # B = 32 MiB, d 256, depths 1, 2, ... 32
    python bench/zero_scale.py --budget-mib 16 --layers 1 2 4   # shorter

4 ranks share the machine's cores: step times are oversubscribed where the ranks outnumber the cores. Writes
``bench/results/zero_scale.json``: the budget, every size tried per side with its bytes (fits or not), the
largest per side, and the losses.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import math
import os
import time

import torch
import torch.distributed as dist

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.memory.peak import StatePeak
from colab_kit.memory.startup import startup_bytes
from colab_kit.models import GPT, GPTConfig

try:
    from _results import row, write
    from _zero_peers import Peer, adamw, model_state
except ImportError:  # run as a module (python -m bench.zero_scale)
    from bench._results import row, write
    from bench._zero_peers import Peer, adamw, model_state

SIDES = {"zero3": "colab_kit zero=3", "zero3-auto": "colab_kit zero=3, offload=\"auto\", device_budget=B",
         "fsdp2": "FSDP2 fully_shard (reshard_after_forward=True), meta + to_empty"}
CONFIGS = {"zero3": dict(zero=3), "zero3-auto": dict(zero=3, offload="auto")}
TIMED = 2  # training steps timed; one more is measured
TOLERANCE = 1e-5


# --------------------------------------------------------------------------- memory of this process
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def _reset_peak() -> int:
    """Free what earlier runs left, restart the peak (VmHWM) from the resident memory now; return that."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return before


# --------------------------------------------------------------------------- FSDP2 on the meta device
def fsdp2_meta(gcfg: GPTConfig, mesh) -> Peer:
    """FSDP2 of ``GPT(gcfg, device="meta")``: shard, ``to_empty``, then re-make each parameter's value.

    A rank holds its shards and, for one parameter at a time, that parameter's full value:

    >>> peer = fsdp2_meta(GPTConfig(vocab_size=512, seq_len=32, d_model=128, n_heads=4, n_layers=2), mesh)  # doctest: +SKIP
    >>> peer.model.tok.weight.to_local().shape      # rank r of 4: rows 128 r .. 128 r + 127 of the token table  # doctest: +SKIP
    torch.Size([128, 128])
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    model = GPT(gcfg, device="meta")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = model.init_parameter(name, torch.empty(p.shape))
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))
            del full
    opt = adamw(model.parameters())
    return Peer(model, opt, lambda: model_state(model.parameters(), opt))


# --------------------------------------------------------------------------- one side, one size, on each rank
def _build(side: str, gcfg: GPTConfig, budget: int, meshes: dict):
    if side == "fsdp2":
        return fsdp2_meta(gcfg, meshes[side])
    cfg = ck.ParallelConfig(dp=dist.get_world_size(), **CONFIGS[side])
    return ck.boost(GPT(gcfg, device="meta"), adamw, cfg, mesh=meshes[side],
                    device_budget=budget if side == "zero3-auto" else None)


def _measure(side: str, gcfg: GPTConfig, budget: int, batch: int, meshes: dict) -> dict:
    """Start-up peak, two timed steps, the in-step peak of a third step, held bytes; this rank's figures."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data, rows = SyntheticTokens(gcfg.vocab_size, gcfg.seq_len, seed=0), batch // world
    before = _reset_peak()
    t0 = time.perf_counter()
    made = _build(side, gcfg, budget, meshes)
    out = {"startup": _status("VmHWM") - before, "build_s": time.perf_counter() - t0}
    if side == "fsdp2":
        def step(s, peer=made):
            x, y = data.batch(s, batch)
            return peer.step(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])
        roots = (made.model, made.optimizer)
    else:
        def step(s, engine=made):
            return engine.train_step(data.batch(s, batch))
        roots = (made.module, made.optimizer, made.data_parallel)
    losses, times = [], []
    try:
        for s in range(TIMED):
            t0 = time.perf_counter()
            losses.append(step(s))
            times.append(time.perf_counter() - t0)
        if side == "zero3-auto":
            losses.append(step(TIMED))
            out["in_step"] = made.data_parallel.placement.account.peak
            out["where"] = {k: v for k, v in made.memory().items() if k in ("device", "host")}
        else:
            with StatePeak(*roots) as meter:
                losses.append(step(TIMED))
            out["in_step"], out["at_peak"] = meter.peak, meter.at_peak
    except ck.ConfigError as exc:  # offload="auto": the budget is too small for one step, on every rank alike
        out["refused"] = str(exc)
    mem = made.memory()
    out["held"] = sum(mem[k] for k in ("params", "grads", "optimizer"))
    out.update(losses=losses, times=times)
    if side != "fsdp2":
        made.close()
    del made, roots, step
    return out


def _size(side: str, layers: int, gpt: dict, budget: int, batch: int, meshes: dict) -> dict:
    """One size of one side, the same verdict on every rank: bytes of the rank with the most."""
    gcfg = GPTConfig(**gpt, n_layers=layers)
    mine = _measure(side, gcfg, budget, batch, meshes)
    worst = torch.tensor([mine["startup"], mine.get("in_step", 0), mine["held"], "refused" in mine],
                         dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    startup, in_step, held, refused = (int(v) for v in worst.tolist())
    out = {"layers": layers, "params": sum(p.numel() for p in GPT(gcfg, device="meta").parameters()),
           "startup": startup, "in_step": in_step, "held": held, "losses": mine["losses"],
           "step_ms": [1e3 * t for t in mine["times"]], "build_s": mine["build_s"]}
    if side != "fsdp2":
        out["startup_estimate"] = startup_bytes(gcfg, ck.ParallelConfig(dp=dist.get_world_size(), **CONFIGS[side]))
    for key in ("at_peak", "where", "refused"):
        if key in mine:
            out[key] = mine[key]
    finite = all(math.isfinite(v) for v in mine["losses"]) and len(mine["losses"]) == TIMED + 1
    out["fits"] = bool(not refused and finite and max(startup, in_step) <= budget)
    out["sum_fits"] = bool(not refused and finite and startup + in_step <= budget)
    return out


def _run(gpt: dict, ladder: list[int], budget: int, batch: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD: a large tensor's pages go back when freed
    world = dist.get_world_size()
    meshes = {side: ck.ProcessMesh.shared(ck.ParallelConfig(dp=world, **kw)) for side, kw in CONFIGS.items()}
    meshes["fsdp2"] = init_device_mesh("cpu", (world,))
    for side in SIDES:  # warm-up, not recorded: lazy imports and first-call paths of each side
        _measure(side, GPTConfig(**{**gpt, "d_model": 64, "n_heads": 4}, n_layers=1), budget, batch, meshes)
    tried = {side: [] for side in SIDES}
    for side in SIDES:
        for layers in ladder:
            tried[side].append(_size(side, layers, gpt, budget, batch, meshes))
            if not tried[side][-1]["fits"]:
                break
    for mesh in (meshes["zero3"], meshes["zero3-auto"]):
        mesh.release()
    return tried


# --------------------------------------------------------------------------- in the launching process
def _largest(tried: list[dict], key: str = "fits") -> dict | None:
    fit = [t for t in tried if t[key]]
    return max(fit, key=lambda t: t["params"]) if fit else None


def _parity(tried: dict) -> dict | None:
    """zero3 against fsdp2 at the largest depth both fit: max relative difference of their losses."""
    both = {t["layers"]: t for t in tried["zero3"] if t["fits"]}
    common = [t for t in tried["fsdp2"] if t["fits"] and t["layers"] in both]
    if not common:
        return None
    peer = max(common, key=lambda t: t["layers"])
    mine = both[peer["layers"]]
    worst = max(abs(a - b) / abs(b) for a, b in zip(mine["losses"], peer["losses"]))
    return {"layers": peer["layers"], "zero3": mine["losses"], "fsdp2": peer["losses"], "max_rel_diff": worst,
            "tolerance": TOLERANCE, "ok": worst <= TOLERANCE}


def _lines(tried: dict, budget: int) -> list[str]:
    head = (f"{'side':<11} {'layers':>6} {'params':>11} {'start-up B':>12} {'in-step B':>12} {'held B':>12} "
            f"{'step ms':>8}  verdict")
    lines = [head, "-" * len(head)]
    for side, sizes in tried.items():
        for t in sizes:
            verdict = ("refused: " + t["refused"][:60] + "...") if "refused" in t else (
                "fits" if t["fits"] else f"over {budget:,} B")
            lines.append(f"{side:<11} {t['layers']:>6} {t['params']:>11,} {t['startup']:>12,} {t['in_step']:>12,} "
                         f"{t['held']:>12,} {t['step_ms'][-1] if t['step_ms'] else float('nan'):>8.1f}  {verdict}")
    return lines


def _summary(tried: dict, budget: int) -> list[str]:
    head = f"{'side':<11} {'largest that fits':>24} {'start-up B':>12} {'in-step B':>12} {'held B':>12} {'step ms':>8}"
    lines = [head, "-" * len(head)]
    for side, sizes in tried.items():
        best = _largest(sizes)
        if best is None:
            lines.append(f"{side:<11} {'none':>24}")
            continue
        lines.append(f"{side:<11} {best['params']:>13,} ({best['layers']:>2} layers) {best['startup']:>12,} "
                     f"{best['in_step']:>12,} {best['held']:>12,} {best['step_ms'][-1]:>8.1f}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget-mib", type=float, default=32.0, help="bytes per rank, in MiB")
    ap.add_argument("--layers", type=int, nargs="+", default=list(range(1, 33)),
                    help="depths tried, upwards, each side until its first that does not fit")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=4)
    args = ap.parse_args(argv)
    budget = int(args.budget_mib * 2**20)
    gpt = dict(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_heads=4)
    cores = os.cpu_count() or 1
    print(f"torch {torch.__version__}, {cores} cores (load average {os.getloadavg()[0]:.1f}), dp={args.ranks}, "
          f"budget {budget:,} B per rank, GPT {gpt}, depths {min(args.layers)}..{max(args.layers)} "
          f"({len(args.layers)}), global batch {args.batch}")
    t0 = time.perf_counter()
    tried = ck.launch(_run, args.ranks, gpt, sorted(args.layers), budget, args.batch, timeout=1800.0)[0]
    print(f"{time.perf_counter() - t0:.0f} s" + (f", OVERSUBSCRIBED: {args.ranks} ranks on {cores} cores"
                                                 if args.ranks > cores else ""))
    print("\nevery size tried (bytes of the rank with the most; fits: max(start-up, in-step) <= budget):")
    print("\n".join(_lines(tried, budget)))
    print(f"\nthe largest that fits under {budget:,} B per rank:")
    print("\n".join(_summary(tried, budget)))
    largest = {side: _largest(sizes) for side, sizes in tried.items()}
    peer = largest["fsdp2"]
    ratios = {side: (largest[side]["params"] / peer["params"] if largest[side] and peer else None)
              for side in ("zero3", "zero3-auto")}
    for side, r in ratios.items():
        print(f"largest parameters, {side} / fsdp2: " + ("-" if r is None else f"{r:.3f}"))
    sums = {side: (_largest(sizes, "sum_fits") or {}).get("params") for side, sizes in tried.items()}
    print("under the stricter rule start-up + in-step <= budget, the largest: " +
          ", ".join(f"{side} {n:,}" if n else f"{side} none" for side, n in sums.items()))
    parity = _parity(tried)
    print("losses, zero3 vs fsdp2: " + ("no depth both fit" if parity is None else
          f"{parity['layers']} layers, max rel diff {parity['max_rel_diff']:.1e} "
          f"({'ok' if parity['ok'] else 'OVER'}, <= {TOLERANCE:.0e})"))
    figures = {"budget": budget, "gpt": gpt, "sides": SIDES, "tried": tried, "largest": largest,
               "ratio_params": ratios, "largest_under_sum_rule": sums, "parity": parity,
               "oversubscribed": args.ranks > cores}
    write("zero_scale", [_row(side, largest[side], peer, ratios.get(side), budget, args, parity) for side in
                         ("zero3", "zero3-auto")], figures, vars(args), argv)


def _describe(t: dict | None) -> str:
    if t is None:
        return "none fits"
    where = " (device and host)" if "where" in t else ""
    return (f"{t['params']:,} params ({t['layers']} layers): start-up {t['startup']:,} B, in-step {t['in_step']:,} B, "
            f"held {t['held']:,} B{where}, {t['step_ms'][-1]:.1f} ms/step")


def _row(side: str, mine: dict | None, peer: dict | None, ratio, budget: int, args, parity) -> dict:
    what = (f"largest GPT (d={args.d_model}, vocab {args.vocab}) that starts and trains under {budget:,} B per rank, "
            f"dp={args.ranks}, {SIDES[side]}, built on meta")
    note = ("ratio: largest parameters colab_kit / FSDP2; fits: max(start-up VmHWM growth, in-step peak) <= budget, "
            "bytes of the rank with the most" + (", device side (placement account)" if side == "zero3-auto" else
                                                 ", StatePeak on both sides"))
    if side == "zero3" and parity is not None:
        note += f"; losses equal FSDP2's within {parity['max_rel_diff']:.1e} at {parity['layers']} layers"
    cores = os.cpu_count() or 1
    if args.ranks > cores:
        note += f"; OVERSUBSCRIBED: {args.ranks} ranks on {cores} cores, the times measure contention too"
    return row(what, _describe(mine), f"{SIDES['fsdp2']}: {_describe(peer)}", ratio, note)


if __name__ == "__main__":
    main()
