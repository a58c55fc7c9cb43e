"""A Hugging Face Llama under tp=2: colab_kit's policy against DTensor ``parallelize_module``, same model, same plan.

Side by side in one run on 2 ranks, alternating in rounds: the same ``transformers.LlamaForCausalLM``
(built from a config, random weights), once handed to ``ck.boost`` (its policy: q/k/v, gate and up
column-parallel, o and down row-parallel, the token table and the LM head split by vocabulary, the
vocab-parallel cross-entropy), once sharded by PyTorch's tensor-parallel API with the plan torchtitan
uses for Llama (``ColwiseParallel`` / ``RowwiseParallel``, the embedding ``RowwiseParallel`` over the
vocabulary, the head ``ColwiseParallel`` with logits left sharded and ``loss_parallel``). Both train
with SGD on the same batches; each step is the whole step (forward, loss, backward, optimizer). Prints
median step times and their ratio (goal <= 1.00), and the largest loss difference between the two.
Writes ``bench/results/models.json``.

Second part, what layout-invariant dropout costs (``colab_kit.models.dropout``), in one process: a
training step (forward, backward, SGD) of the built-in GPT and of a Hugging Face GPT-2 with every dropout
at 0.1, once as their users run them (``nn.Dropout`` from torch's RNG; GPT-2 with its default SDPA
attention) and once with colab_kit's masks (GPT-2 then runs transformers' eager attention with them), in
alternating rounds; and the dropout alone, forward and backward of one ``[batch, seq, hidden]`` tensor.
Prints each median and the ratio (colab_kit / torch).

    python bench/models.py                  # both parts
    python bench/models.py --only dropout   # one part (the JSON then holds that part alone)
    python bench/models.py --rounds 3 --hidden 128
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import colab_kit as ck

try:
    from _results import row, write
except ImportError:  # run as a module (python -m bench.models)
    from bench._results import row, write


def _llama(args):
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=args["hidden"], intermediate_size=args["hidden"] * 8 // 3 // 8 * 8,
                                   num_hidden_layers=args["layers"], num_attention_heads=8, num_key_value_heads=4,
                                   vocab_size=args["vocab"], max_position_embeddings=args["seq"], bos_token_id=0,
                                   eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _dtensor(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}"
        plan.update({f"{p}.self_attn.q_proj": ColwiseParallel(), f"{p}.self_attn.k_proj": ColwiseParallel(),
                     f"{p}.self_attn.v_proj": ColwiseParallel(), f"{p}.self_attn.o_proj": RowwiseParallel(),
                     f"{p}.mlp.gate_proj": ColwiseParallel(), f"{p}.mlp.up_proj": ColwiseParallel(),
                     f"{p}.mlp.down_proj": RowwiseParallel()})
    return parallelize_module(model, mesh, plan)


def _compare(args):
    from torch.distributed.tensor.parallel import loss_parallel

    torch.set_num_threads(1)
    world = torch.distributed.get_world_size()
    opt = lambda ps: torch.optim.SGD(ps, lr=args["lr"])  # noqa: E731
    engine = ck.boost(_llama(args), opt, ck.ParallelConfig(tp=world))
    theirs = _dtensor(_llama(args), world)
    their_opt = opt(theirs.parameters())
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args["steps"]):
        seq = torch.randint(1, args["vocab"], (args["batch"], args["seq"] + 1), generator=g)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))

    def dtensor_step(x, y):
        their_opt.zero_grad()
        logits = theirs(x).logits
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
        their_opt.step()
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()

    steps = {"colab_kit": lambda x, y: engine.train_step((x, y)), "dtensor": dtensor_step}
    times, losses = {k: [] for k in steps}, {k: [] for k in steps}
    for r in range(args["rounds"] + 1):  # round 0 warms up
        for name in (("colab_kit", "dtensor") if r % 2 == 0 else ("dtensor", "colab_kit")):
            torch.distributed.barrier()
            for x, y in batches:
                t0 = time.perf_counter()
                value = steps[name](x, y)
                if r:
                    times[name].append(time.perf_counter() - t0)
                if r == 0:
                    losses[name].append(value)
    return {"times": times, "losses": losses}


def _drop_models(args):
    import transformers
    from colab_kit.models import GPT, GPTConfig
    from colab_kit.models.dropout import layout_invariant
    transformers.logging.set_verbosity_error()
    h, n, t, v = args["hidden"], args["layers"], args["seq"], args["vocab"]

    def gpt(ours):
        m = GPT(GPTConfig(vocab_size=v, seq_len=t, d_model=h, n_heads=8, n_layers=n, dropout=0.1))
        if not ours:  # what a user of plain PyTorch has: torch's nn.Dropout
            for d in m.modules():
                if isinstance(d, torch.nn.Dropout):
                    d.__class__ = torch.nn.Dropout
        return m, lambda x: m(x)

    def gpt2(ours):
        torch.manual_seed(0)
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=v, n_positions=t, n_embd=h, n_layer=n, n_head=8, bos_token_id=0, eos_token_id=0))
        return (layout_invariant(m) if ours else m), lambda x: m(x).logits

    return {"GPT": gpt, "HF GPT-2": gpt2}


def _dropout_cost(args):
    """Median seconds of a training step with torch's and colab_kit's dropout, and of the dropout alone."""
    from colab_kit.models.dropout import Dropout
    torch.set_num_threads(args["threads"])
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(1, args["vocab"], (args["batch"], args["seq"] + 1), generator=g)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    out = {}
    for name, build in _drop_models(args).items():
        steps = {}
        for which in ("torch", "colab_kit"):
            model, fwd = build(which == "colab_kit")
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=args["lr"])

            def step(model=model, fwd=fwd, opt=opt):
                loss = F.cross_entropy(fwd(x).flatten(0, 1), y.flatten())
                opt.zero_grad()
                loss.backward()
                opt.step()
            steps[which] = step
        out[name] = _alternate(steps, args)
    act = torch.randn(args["batch"], args["seq"], args["hidden"], requires_grad=True)
    mods = {"torch": torch.nn.Dropout(0.1), "colab_kit": Dropout(0.1)}
    out["dropout alone"] = _alternate({k: (lambda m=m: m(act).sum().backward()) for k, m in mods.items()},
                                      {**args, "steps": 20})
    return out


def _alternate(steps, args):
    times = {k: [] for k in steps}
    for r in range(args["rounds"] + 1):  # round 0 warms up
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            for _ in range(args["steps"]):
                t0 = time.perf_counter()
                steps[name]()
                if r:
                    times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the dropout part")
    ap.add_argument("--only", choices=("tp", "dropout"), default=None)
    args = vars(ap.parse_args(argv))
    result = {}
    if args["only"] != "dropout":
        result.update(_tp_part(args))
    if args["only"] != "tp":
        drop = _dropout_cost(args)
        print(f"dropout 0.1, one process, {args['threads']} thread(s), batch {args['batch']} x seq {args['seq']} x "
              f"hidden {args['hidden']}, {args['layers']} layers; median ms, colab_kit's masks / torch's nn.Dropout")
        for name, med in drop.items():
            print(f"  {name:14s} torch {med['torch']:8.2f}   colab_kit {med['colab_kit']:8.2f}   "
                  f"ratio {med['colab_kit'] / med['torch']:.3f}")
        result["dropout"] = {"args": args, "median_ms": drop,
                             "ratio": {k: v["colab_kit"] / v["torch"] for k, v in drop.items()}}
    rows = []
    if "median_ms" in result:
        a = result["args"]
        rows.append(row(f"Hugging Face Llama (d={a['hidden']} x {a['layers']}), tp=2, whole model, batch {a['batch']}",
                        f"ck.boost tp=2 {result['median_ms']['colab_kit']:.1f} ms/step",
                        f"DTensor parallelize_module {result['median_ms']['dtensor']:.1f} ms/step", result["ratio"],
                        f"ratio of medians (goal <= 1.00); losses within {result['max_loss_rel_diff']:.1e}"))
    for name, r in result.get("dropout", {}).get("ratio", {}).items():
        med = result["dropout"]["median_ms"][name]
        rows.append(row(f"dropout 0.1 whose masks do not depend on the split, {name}, one process",
                        f"{med['colab_kit']:.2f} ms/step", f"torch nn.Dropout {med['torch']:.2f} ms/step", r,
                        "ratio of medians"))
    write("models", rows, result, args, argv)


def _tp_part(args):
    res = ck.launch(_compare, 2, args)[0]
    med = {k: statistics.median(v) * 1e3 for k, v in res["times"].items()}
    worst = max(abs(a - b) / abs(b) for a, b in zip(res["losses"]["colab_kit"], res["losses"]["dtensor"]))
    ratio = med["colab_kit"] / med["dtensor"]
    print(f"HF Llama {args}, tp=2 on 2 CPU ranks, {args['rounds']} rounds x {args['steps']} steps")
    print(f"median step time   colab_kit {med['colab_kit']:.1f} ms   DTensor parallelize_module {med['dtensor']:.1f} ms"
          f"   ratio {ratio:.3f} (goal <= 1.00)")
    print(f"largest relative loss difference between the two (first round): {worst:.1e}; losses "
          + "  ".join(f"{k} " + " ".join(f"{v:.4f}" for v in vs) for k, vs in res["losses"].items()))
    return {"args": {k: v for k, v in args.items() if k not in ("only", "threads")}, "median_ms": med,
            "ratio": ratio, "max_loss_rel_diff": worst}

if __name__ == "__main__":
    main()
