"""GPU check of heterogeneous memory and ZeRO (run where a GPU is lent; CI never needs it).

On a machine without a GPU the "device" of ``offload`` is an account over host memory
(``colab_kit.zero.offload``). Here, with CUDA, the chunks really move: this script checks,
on one rank per GPU (NCCL):

1. zero=3 and zero=3 + offload="cpu" train to the single-process losses (fp32, 1e-5), and
   with "cpu" every chunk's shard, gradient and optimizer states are on the CPU;
2. offload="auto" under a ``device_budget`` below the model states: the chunks the placement
   put on the host are CPU tensors, those on the device CUDA tensors, the losses match, and
   ``torch.cuda.max_memory_allocated()`` during steps 2-5 stays within the budget plus what the
   account does not see (CUDA's allocator rounding and the CUDA context's workspace: printed);
3. precision="bf16" trains (losses printed beside the fp32 ones).

    python bench/gpu_check.py            # exits 1 if a check fails, 0 if all pass, 2 without CUDA
"""
from __future__ import annotations

import sys

import torch

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig
from colab_kit.reference import train_single_process

CFG = dict(vocab_size=256, seq_len=64, d_model=256, n_heads=8, n_layers=6)
STEPS, BATCH = 5, 8


def _adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-3)


def _run(kw: dict, budget: int | None = None):
    data = SyntheticTokens(CFG["vocab_size"], CFG["seq_len"], seed=1)
    engine = ck.boost(GPT(GPTConfig(**CFG)), _adamw, ck.ParallelConfig(**kw), device_budget=budget)
    losses, peaks = [], []
    for s in range(STEPS):
        torch.cuda.reset_peak_memory_stats()
        losses.append(engine.train_step(data.batch(s, BATCH)))
        peaks.append(torch.cuda.max_memory_allocated())
    out = {"losses": losses, "peaks": peaks, "memory": engine.memory()}
    place = getattr(engine.grads, "placement", None)
    if place is not None:
        out["where"] = list(place.where)
        out["devices"] = [sorted({t.device.type for t in place.state_tensors(i)}) for i in range(len(place.chunks))]
        out["account_peak"] = place.account.peak
    engine.close()
    return out


def _rank(world: int):
    n = world
    results = {"zero3": _run(dict(dp=n, zero=3)), "cpu": _run(dict(dp=n, zero=3, offload="cpu"))}
    states = sum(results["zero3"]["memory"][k] for k in ("params", "grads", "optimizer"))
    budget = int(0.8 * states + results["cpu"]["peaks"][-1])
    results["auto"] = _run(dict(dp=n, zero=3, offload="auto"), budget)
    results["auto"]["budget"] = budget
    try:
        results["bf16"] = _run(dict(dp=n, zero=2, precision="bf16"))
    except ck.ConfigError as exc:
        results["bf16"] = {"refused": str(exc)}
    return results


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (the CPU account is tested in tests/test_zero3.py)")
        return 2
    world = torch.cuda.device_count()
    res = ck.launch(_rank, world, world)[0]
    ref, _ = train_single_process(GPTConfig(**CFG), _adamw, SyntheticTokens(CFG["vocab_size"], CFG["seq_len"], seed=1),
                                  STEPS, BATCH)
    ok = True

    def check(name, cond, detail=""):
        nonlocal ok
        ok &= bool(cond)
        print(f"{'PASS' if cond else 'FAIL'}  {name}  {detail}")

    for key in ("zero3", "cpu", "auto"):
        worst = max(abs(a - b) / abs(b) for a, b in zip(res[key]["losses"], ref))
        check(f"{key} losses = one process", worst <= 1e-5, f"max rel {worst:.2e}")
    check("cpu: every chunk's states on the CPU", all(d == ["cpu"] for d in res["cpu"]["devices"]), res["cpu"]["devices"])
    auto = res["auto"]
    placed = all(d == (["cuda"] if w == "device" else ["cpu"]) for d, w in zip(auto["devices"], auto["where"]))
    check("auto: tensors where the placement says", placed, list(zip(auto["where"], auto["devices"])))
    check("auto: some chunks on each side", {"device", "host"} <= set(auto["where"]), auto["where"])
    over = max(auto["peaks"][1:]) - auto["budget"]
    print(f"      auto: budget {auto['budget']:,} B, account peak {auto['account_peak']:,} B, CUDA peak after "
          f"step 1 {max(auto['peaks'][1:]):,} B ({over:+,} B beyond the budget: allocator rounding, workspaces)")
    check("auto: account within the budget", auto["account_peak"] <= auto["budget"])
    print("      bf16:", res["bf16"].get("refused") or [f"{x:.4f}" for x in res["bf16"]["losses"]],
          "fp32:", [f"{x:.4f}" for x in ref])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
