"""``engine.fit`` under torchrun with ``--max-restarts``: rank 1 dies at step DIE on the first attempt;
torchrun starts every rank again, and fit continues from the last complete checkpoint.

    torchrun --nproc-per-node 2 --max-restarts 1 tests/scripts/torchrun_fit.py CKPT "dp=2" STEPS EVERY DIE

Rank 0 prints one JSON line at the end: {"history": [...], "restart": n, "resumed_from": step}.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

import colab_kit as ck
from colab_kit.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)
path, words, steps, every, die = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
config = ck.ParallelConfig.parse(words)
ck.init(config)
torch.set_num_threads(1)
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
engine = ck.boost(GPT(CFG), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), config)
x, y = ck.datasets.SyntheticTokens(64, 16, seed=3).batch(0, 64)
loader = engine.loader([(x[i], y[i]) for i in range(64)], 8, seed=0)
start = [None]


def maybe_die(eng, loss):
    if start[0] is None:
        start[0] = eng.step_count - 1
    if restart == 0 and dist.get_rank() == 1 and eng.step_count == die:
        os._exit(17)  # a rank that dies mid-run, without a word


engine.fit(loader, steps, checkpoint=path, every=every, on_step=maybe_die)
if dist.get_rank() == 0:
    print(json.dumps({"history": list(engine.history), "restart": restart, "resumed_from": start[0]}), flush=True)
engine.close()
dist.destroy_process_group()
