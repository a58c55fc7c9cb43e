"""A training script as a cluster user writes it: ``ck.init()`` first, then the same code as in a notebook.

    torchrun --nproc-per-node 4 tests/scripts/torchrun_train.py "dp=2 tp=2" 4

Prints, on rank 0, one JSON line: {"losses": [...], "world_size", "backend", "gloo_ifname", "hosts"}, and
at the interpreter's exit (a hook registered before ``ck.init``'s, so it runs after it) whether any process
group was left: the script, like an exported one, never destroys its group itself.
"""
import atexit
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

import colab_kit as ck
from colab_kit.datasets import SyntheticTokens
from colab_kit.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=2)

atexit.register(lambda: os.write(1, f"\nAT EXIT the process group is {'left' if dist.is_initialized() else 'destroyed'}\n"
                                   .encode()))  # one write: the ranks' lines never interleave
config = ck.ParallelConfig.parse(sys.argv[1])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
job = ck.init(config, timeout=float(os.environ.get("CK_TEST_TIMEOUT", "120")))
torch.set_num_threads(1)
engine = ck.boost(GPT(CFG), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), config)
data = SyntheticTokens(64, 16, seed=1)
losses = [engine.train_step(data.batch(s, 8)) for s in range(steps)]
hosts = [None] * dist.get_world_size()
dist.all_gather_object(hosts, (socket.gethostname(), os.environ.get("GLOO_SOCKET_IFNAME")))
if dist.get_rank() == 0:
    print(json.dumps({"losses": losses, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
                      "launcher": job.launcher if job else None, "ifnames": [h[1] for h in hosts]}), flush=True)
engine.close()
