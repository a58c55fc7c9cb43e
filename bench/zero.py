"""ZeRO 1/2/3, offload and bf16: colab_kit against its PyTorch-native peer, side by side, at dp=2 and dp=4.

One run puts each colab_kit configuration beside the PyTorch-native run a user would pick
instead (``bench/_zero_peers.py`` builds the peers), on the same local ranks, the same GPT
(same seed), the same batches, AdamW:

    zero3          colab_kit zero=3                  FSDP2 fully_shard (reshard_after_forward=True), per block + root
    zero2          colab_kit zero=2                  FSDP2 fully_shard(reshard_after_forward=False)
    zero1          colab_kit zero=1                  DDP + torch.distributed.optim.ZeroRedundancyOptimizer
    zero3-offload  colab_kit zero=3, offload="cpu"   FSDP2 + CPUOffloadPolicy(pin_memory=False)
    bf16-zero2     colab_kit zero=2, bf16            FSDP2 (reshard_after_forward=False) + MixedPrecisionPolicy
    bf16-zero3     colab_kit zero=3, bf16            FSDP2 (reshard_after_forward=True) + MixedPrecisionPolicy
                   (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))

Both sides step the same AdamW, ``foreach=True`` (one fused call per op over every tensor: colab_kit's few
flat pieces, the peer's ~50 DTensors or parameters), so the ratio compares sharding, not optimizer dispatch;
the peer also runs with torch's default AdamW (on CPU a per-tensor loop), as a user who left it alone would,
and that ratio is printed beside. Each step is timed whole (forward, backward, gradient reduction, optimizer
step, parameter gather, the global loss). The sides alternate in short rounds (colab_kit, peer, default;
then reversed), so that machine noise hits them alike; the headline ratio is the median over rounds of
colab_kit / peer of adjacent rounds (goal <= 1.00), printed beside each side's median step time. Writes
``bench/results/zero.json``. Losses: both
sides' global losses step by step, max relative difference, against 1e-5 in fp32 and the looser
2^-7 (bf16's machine epsilon) with bf16. A configuration colab_kit refuses (``ck.ConfigError``)
prints "not runnable yet: <message>".

Bytes, two figures per side, for the rank that has the most (goal: colab_kit at most the peer's):

- held: the model states (params + grads + optimizer) held after a step, the most over the
  rounds; colab_kit from ``engine.memory()`` (host and device together), the peer from its local
  tensors (DTensor ``to_local()``) and its optimizer states;
- peak: the most model-state bytes held at once inside one more step (not timed), measured on
  both sides by the same instrument, ``colab_kit.memory.peak.StatePeak`` (after every dispatched
  op: the storages reachable from the model, the optimizer and the parallel part, and the live
  storages the parallel machinery allocated: colab_kit's buckets and chunks, FSDP2's unsharded
  parameters, all-gather and reduce-scatter buffers; each storage once, at its size then).

Read the held bytes with what each side keeps between steps: ZeRO-2 (colab_kit zero=2) keeps the
parameters whole, while FSDP2 with reshard_after_forward=False still reshards them after
backward, so zero2's held ratio is (4 + 12/N) / (16/N), not a leak. Inside the step FSDP2 holds
its sharded parameters beside the unsharded ones, and colab_kit's stage 2 holds at most two
gradient buckets beside its pieces (``colab_kit.zero.stage2``): the peak is where they compare.
With bf16, colab_kit keeps whole bf16 parameters and fp32 masters of its pieces, FSDP2 fp32
sharded parameters (its masters) and casts them to bf16 at each all-gather.

    python bench/zero.py                          # dp=2 and dp=4, 8 rounds x 3 steps per pair
    python bench/zero.py --ranks 2 --rounds 20    # one dp, more rounds
    python bench/zero.py --pairs zero3 bf16-zero3
    python bench/zero.py --rounds 2 --steps 2     # short: bytes are exact, times noisy
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.memory.peak import StatePeak
from colab_kit.models import GPT, GPTConfig

try:
    from _results import row, write
    from _zero_peers import PEERS, adamw
except ImportError:  # run as a module (python -m bench.zero)
    from bench._results import row, write
    from bench._zero_peers import PEERS, adamw

DEFAULT_PAIRS = ("zero3", "zero2", "zero1", "zero3-offload", "bf16-zero2", "bf16-zero3")
THRESHOLD = {"fp32": 1e-5, "bf16": 2.0 ** -7}
STATES = ("params", "grads", "optimizer")


def _ck_label(fields: dict) -> str:
    return "zero=%d" % fields["zero"] + "".join(f", {k}={v!r}" for k, v in fields.items() if k != "zero")


def _pair(name: str, gcfg: GPTConfig, batch: int, rounds: int, steps: int) -> dict:
    """One pair on this rank: ABBA rounds of colab_kit and its peer; times, losses, bytes held."""
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    fields, _label, build, _tol = PEERS[name]
    data = SyntheticTokens(gcfg.vocab_size, gcfg.seq_len, seed=0)
    try:  # refused before any collective, on every rank alike
        engine = ck.boost(GPT(gcfg), adamw, ck.ParallelConfig(dp=world, **fields))
    except ck.ConfigError as exc:
        return {"refused": str(exc)}
    peer, default = build(gcfg), build(gcfg, None)  # the same AdamW (foreach) on both sides; the peer's default too
    rows = batch // world

    def peer_step(side, step):
        x, y = data.batch(step, batch)
        return side.step(x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows])

    def held(mem: dict) -> dict:
        return {k: mem[k] for k in STATES}

    names = ("colab_kit", "peer", "peer_default")
    runners = {"colab_kit": lambda s: engine.train_step(data.batch(s, batch)), "peer": lambda s: peer_step(peer, s),
               "peer_default": lambda s: peer_step(default, s)}
    memory = {"colab_kit": lambda: held(engine.memory()), "peer": peer.memory, "peer_default": default.memory}
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    per_round = {n: [] for n in names}
    peak = {n: dict.fromkeys(STATES, 0) for n in names}
    for r in range(rounds + 1):  # round 0 warms up both
        for side in (names if r % 2 == 0 else names[::-1]):
            dist.barrier()
            mine = []
            for s in range(steps):
                t0 = time.perf_counter()
                loss = runners[side](r * steps + s)
                if r:
                    mine.append(time.perf_counter() - t0)
                    losses[side].append(loss)
            if r:
                times[side] += mine
                per_round[side].append(statistics.median(mine))
            now = memory[side]()  # after a step, outside the timed steps
            if sum(now.values()) > sum(peak[side].values()):
                peak[side] = now
    inside = {}
    roots = {"colab_kit": (engine.module, engine.optimizer, engine.data_parallel), "peer": (peer.model, peer.optimizer)}
    for side in names[:2]:  # one more step each (the same batch), under the meter, not timed
        dist.barrier()
        with StatePeak(*roots[side]) as meter:
            runners[side]((rounds + 1) * steps)
        inside[side] = {"total": meter.peak, **meter.at_peak}
    engine.close()
    dist.barrier()
    return {"times": times, "losses": losses, "per_round": per_round, "peak": peak, "inside": inside}


def _run(gpt_kwargs: dict, batch: int, rounds: int, steps: int, pairs: list[str]) -> dict:
    gcfg = GPTConfig(**gpt_kwargs)
    out = {name: _pair(name, gcfg, batch, rounds, steps) for name in pairs}
    out["n_params"] = sum(p.numel() for p in GPT(gcfg).parameters())
    return out


def _summary(name: str, results: list[dict]) -> dict:
    """One row from every rank's results of one pair."""
    res = results[0][name]
    if "refused" in res:
        return {"refused": res["refused"]}
    tol = THRESHOLD[PEERS[name][3]]
    med = {k: statistics.median(v) * 1e3 for k, v in res["times"].items()}
    paired = statistics.median(a / b for a, b in zip(res["per_round"]["colab_kit"], res["per_round"]["peer"]))
    paired_default = statistics.median(a / b for a, b in zip(res["per_round"]["colab_kit"],
                                                             res["per_round"]["peer_default"]))
    worst = max(abs(a - b) / abs(b) for a, b in zip(res["losses"]["colab_kit"], res["losses"]["peer"]))
    most, inside = {}, {}
    for side in ("colab_kit", "peer"):  # the rank that holds the most model-state bytes
        most[side] = max((r[name]["peak"][side] for r in results), key=lambda m: sum(m.values()))
        inside[side] = max((r[name]["inside"][side] for r in results), key=lambda m: m["total"])
    return {"med": med, "paired": paired, "paired_default": paired_default, "worst": worst, "tol": tol, "most": most, "inside": inside,
            "steps": len(res["times"]["colab_kit"])}


def _table(rows: list[tuple[int, str, dict]]) -> list[str]:
    head = (f"{'dp':>2}  {'pair':<13} {'ck ms':>8} {'peer ms':>8} {'ratio':>6} {'dflt ms':>8} {'ratio':>6}  "
            f"{'ck held':>10} {'peer held':>10} {'held':>6}  {'ck peak':>10} {'peer peak':>10} {'peak':>6}  "
            f"{'loss max rel diff':<24}")
    lines = [head, f"{'':>2}  {'':<13} {'median':>8} {'median':>8} {'rounds':>6} {'median':>8} {'rounds':>6}  "
                   f"{'B/rank':>10} {'B/rank':>10} {'ck/peer':>6}  {'B/rank':>10} {'B/rank':>10} {'ck/peer':>6}",
             "-" * len(head)]
    for dp, name, s in rows:
        if "refused" in s:
            lines.append(f"{dp:>2}  {name:<13} not runnable yet: {s['refused']}")
            continue
        ck_b, peer_b = (sum(s["most"][k].values()) for k in ("colab_kit", "peer"))
        ck_p, peer_p = (s["inside"][k]["total"] for k in ("colab_kit", "peer"))
        ok = "ok" if s["worst"] <= s["tol"] else "OVER"
        lines.append(f"{dp:>2}  {name:<13} {s['med']['colab_kit']:>8.2f} {s['med']['peer']:>8.2f} "
                     f"{s['paired']:>6.3f} {s['med']['peer_default']:>8.2f} {s['paired_default']:>6.3f}  "
                     f"{ck_b:>10,} {peer_b:>10,} {ck_b / peer_b:>6.3f}  "
                     f"{ck_p:>10,} {peer_p:>10,} {ck_p / peer_p:>6.3f}  {s['worst']:.2e} ({ok}, <= {s['tol']:.1e})")
    return lines


def _breakdown(rows: list[tuple[int, str, dict]]) -> list[str]:
    lines = ["model-state bytes of the rank holding the most, colab_kit / peer, held after a step:"]
    for dp, name, s in rows:
        if "refused" not in s:
            cells = "   ".join(f"{k} {s['most']['colab_kit'][k]:,} / {s['most']['peer'][k]:,}" for k in STATES)
            lines.append(f"  dp={dp} {name:<13} {cells}")
    lines.append("at the in-step peak (StatePeak; other: buffers found in the parallel parts, in flight or gathered):")
    for dp, name, s in rows:
        if "refused" not in s:
            cells = "   ".join(f"{k} {s['inside']['colab_kit'][k]:,} / {s['inside']['peer'][k]:,}"
                               for k in STATES + ("other",))
            lines.append(f"  dp={dp} {name:<13} {cells}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="dp sizes to run, one launch each")
    ap.add_argument("--pairs", nargs="+", default=list(DEFAULT_PAIRS), choices=list(PEERS))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-model-4", type=int, default=None,
                    help="d_model for dp >= 4 (default: --d-model); smaller keeps an oversubscribed run short")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    load = "load average %.1f %.1f %.1f" % os.getloadavg()
    print(f"torch {torch.__version__}, {cores} cores ({load} at start), AdamW lr=1e-3 foreach, global batch {args.batch}, "
          f"{args.rounds} rounds x {args.steps} steps a side after a warm-up round")
    for name in args.pairs:
        fields, label, _, _ = PEERS[name]
        print(f"  {name:<13} colab_kit {_ck_label(fields):<34} vs {label}")
    rows = []
    for dp in args.ranks:
        d = args.d_model_4 if dp >= 4 and args.d_model_4 else args.d_model
        gpt = dict(vocab_size=256, seq_len=args.seq, d_model=d, n_heads=4, n_layers=args.layers)
        t0 = time.perf_counter()
        results = ck.launch(_run, dp, gpt, args.batch, args.rounds, args.steps, args.pairs, timeout=1800.0)
        note = f", OVERSUBSCRIBED: {dp} ranks on {cores} cores, times not representative" if dp > cores else ""
        print(f"dp={dp}: GPT {gpt} ({results[0]['n_params']:,} parameters, dense AdamW states "
              f"{8 * results[0]['n_params']:,} B), {time.perf_counter() - t0:.0f} s{note}", flush=True)
        rows += [(dp, name, _summary(name, results)) for name in args.pairs]
    print()
    print("\n".join(_table(rows)))
    print("ratio: median over rounds of colab_kit / peer of adjacent rounds (goal <= 1.00), both sides with AdamW "
          "foreach=True; dflt: the peer with torch's default AdamW (a per-tensor loop on CPU); held: params + "
          "grads + optimizer held after a step, most over rounds; peak: the most model-state bytes at once inside "
          "one step, the same meter on both sides (colab_kit.memory.peak.StatePeak); bytes of the rank with the most "
          "(goal ck/peer <= 1.00)")
    over = [dp for dp in args.ranks if dp > cores]
    if over:
        print(f"dp={', '.join(map(str, over))} ran more ranks than the {cores} cores: oversubscribed, so those step "
              f"times measure contention as much as the engines")
    print("\n".join(_breakdown(rows)))
    print("load average %.1f %.1f %.1f at the end" % os.getloadavg())
    write("zero", [_result_row(dp, name, s, args) for dp, name, s in rows],
          {f"dp={dp} {name}": s for dp, name, s in rows}, vars(args), argv)


def _result_row(dp: int, name: str, s: dict, args) -> dict:
    fields, label, _, _ = PEERS[name]
    what = f"ZeRO {_ck_label(fields)}, dp={dp}, GPT d={args.d_model} x {args.layers} layers, batch {args.batch}"
    if "refused" in s:
        return row(what, f"not runnable: {s['refused']}", label, None)
    ck_b, peer_b = (sum(s["most"][k].values()) for k in ("colab_kit", "peer"))
    ck_p, peer_p = (s["inside"][k]["total"] for k in ("colab_kit", "peer"))
    return row(what, f"{s['med']['colab_kit']:.2f} ms/step; held {ck_b:,} B, peak {ck_p:,} B",
               f"{label}, AdamW foreach: {s['med']['peer']:.2f} ms/step; held {peer_b:,} B, peak {peer_p:,} B",
               s["paired"], f"median of adjacent-round ratios, same AdamW (foreach) on both sides; against the "
                            f"peer with torch's default AdamW ({s['med']['peer_default']:.2f} ms/step) "
                            f"{s['paired_default']:.3f}; held {ck_b / peer_b:.3f}x, peak {ck_p / peer_p:.3f}x; "
                            f"losses within {s['worst']:.1e}" + _oversubscribed(dp))


def _oversubscribed(dp: int) -> str:
    cores = os.cpu_count() or 1
    return f"; OVERSUBSCRIBED: {dp} ranks on {cores} cores, the times measure contention too" if dp > cores else ""


if __name__ == "__main__":
    main()
