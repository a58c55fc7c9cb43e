"""The host's seconds an operator, measured on the training program itself (``bench/gpu_curves.py``'s ``program``).

Eager PyTorch issues a step's operators one at a time from the host (Python, the engine, the dispatcher,
autograd, the launch). ``planner.cluster.host`` prices that floor as operators a step (counted per family on
the engine) times seconds an operator. A tiny ``add_`` issued in a loop (gpu_curves' ``launch``) measures only
the cheapest operator: a training step's operators go through ``nn.Module`` calls, autograd's graph and the
engine's hooks, and cost several times more each. So this sweep times the program itself.

Each family the floor counts (the built-in GPT and its mixture of experts; Hugging Face's Llama and Mixtral
where ``transformers`` is installed) is built at a tiny width (d 64, seq 64, 2 rows, 12 blocks) and trained
on one rank of the device through ``ck.boost`` (bf16, AdamW ``foreach=True``), as the GPU checks train their
models. The operator count does not depend on the widths, but the GPU's work does: at this width each kernel
is a few microseconds, under the host's time to issue it, so the GPU waits for the host and a step takes the
host's time. The step after the warm-up steps is counted (``observe.ops.count_ops``), the next ``timed`` are
timed (each synchronised), and the median step / the operators counted is the family's host seconds an
operator (``Hardware.family_op_seconds``, taken by ``curve_fit.measured_preset``).

A row, worked (the CPU of this project's 2-core test machine, gloo; ``python bench/op_count.py``)::

    {"family": "gpt", "ops": 2117, "step_seconds": 0.0223, "seconds_per_op": 1.05e-05, ...}

Where the step is not host-bound (a slow GPU, a fast host), the figure is an upper bound: on a GPU one more
step runs under ``torch.profiler``, and ``device_busy_seconds`` (the union of its kernels' intervals:
``_gpu_copies.busy_seconds``) over ``step_seconds`` says how much of the step the GPU was busy for.
"""
from __future__ import annotations

import statistics
import time

FAMILIES = ("gpt", "gpt-moe", "llama", "hf-moe")
SIZES = {"cuda": dict(layers=12, warmup=3, timed=10, timeout=150.0),
         "cpu": dict(layers=2, warmup=1, timed=2, timeout=120.0)}
_WIDTH = dict(vocab=256, seq=64, d_model=64, heads=2, d_ff=128, experts=8, top_k=2, rows=2)


def build(family: str, layers: int):
    """The tiny model of ``family`` (``FAMILIES``) with ``layers`` blocks, drawn from seed 0."""
    import torch

    from colab_kit.models import GPT, GPTConfig
    w = _WIDTH
    torch.manual_seed(0)
    gpt = dict(vocab_size=w["vocab"], seq_len=w["seq"], d_model=w["d_model"], n_heads=w["heads"], n_layers=layers)
    if family == "gpt":
        return GPT(GPTConfig(**gpt))
    if family == "gpt-moe":
        return GPT(GPTConfig(**gpt, n_experts=w["experts"], top_k=w["top_k"], d_expert=w["d_ff"], aux_loss=0.01))
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")
    import transformers as tf  # the extra: a family without it is skipped by the sweep

    tf.logging.set_verbosity_error()
    common = dict(vocab_size=w["vocab"], hidden_size=w["d_model"], intermediate_size=w["d_ff"],
                  num_attention_heads=w["heads"], num_key_value_heads=w["heads"], max_position_embeddings=w["seq"],
                  num_hidden_layers=layers)
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_experts_per_tok=w["top_k"],
                                                  num_local_experts=w["experts"], output_router_logits=True,
                                                  router_aux_loss_coef=0.01, eos_token_id=None, pad_token_id=None,
                                                  bos_token_id=None))


def _rank(sizes: dict, families: tuple) -> list[dict]:
    """On the one rank: each family's row (``step``'s), or its error; an error ends that family only."""
    import torch

    out = []
    for family in families:
        try:
            out.append({"family": family, **step(family, sizes)})
        except ImportError as exc:
            out.append({"family": family, "skipped": f"{type(exc).__name__}: {exc}"})
        except Exception as exc:  # noqa: BLE001 - recorded in the row; the other families still run
            out.append({"family": family, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def step(family: str, sizes: dict) -> dict:
    """One family's tiny model trained on this rank: its operators a step and host seconds an operator."""
    import torch

    import colab_kit as ck
    from colab_kit.datasets import SyntheticTokens
    from colab_kit.observe.ops import count_ops
    model = build(family, sizes["layers"])
    engine = ck.boost(model, lambda ps: torch.optim.AdamW(ps, lr=3e-4, foreach=True),
                      ck.ParallelConfig(precision="bf16"))
    cuda = engine.mesh.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    data = SyntheticTokens(_WIDTH["vocab"], _WIDTH["seq"], seed=2)
    try:
        for i in range(sizes["warmup"]):
            engine.train_step(data.batch(i, _WIDTH["rows"]))
        sync()
        counted = count_ops(lambda: engine.train_step(data.batch(sizes["warmup"], _WIDTH["rows"])))
        sync()
        times = []
        for i in range(sizes["timed"]):
            batch = data.batch(sizes["warmup"] + 1 + i, _WIDTH["rows"])
            t0 = time.perf_counter()
            engine.train_step(batch)
            sync()
            times.append(time.perf_counter() - t0)
        busy = _busy(engine, data.batch(sizes["warmup"] + 1 + sizes["timed"], _WIDTH["rows"])) if cuda else None
    finally:
        engine.close()
    seconds = statistics.median(times)
    return {"layers": sizes["layers"], "precision": "bf16", "ops": counted["ops"], "host_reads": counted["host_reads"],
            "step_seconds": seconds, "seconds_per_op": seconds / counted["ops"], "device_busy_seconds": busy,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu"}


def _busy(engine, batch) -> float:
    """Seconds the GPU ran kernels or copies during one step (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile
    try:
        from _gpu_copies import busy_seconds
    except ImportError:  # python -m bench....
        from bench._gpu_copies import busy_seconds
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.train_step(batch)
    return busy_seconds(prof)


def measure_program(cuda: bool, families: tuple = FAMILIES, sizes: dict | None = None,
                    timeout: float | None = None) -> list[dict]:
    """Each family's row, from one spawned rank (NCCL on the GPU, gloo on the CPU): ``step``'s figures, or
    ``skipped`` (no ``transformers``) or ``error``; ``timeout`` (default the sizes') bounds the rank."""
    import colab_kit as ck
    sizes = sizes or SIZES["cuda" if cuda else "cpu"]
    return ck.launch(_rank, 1, sizes, tuple(families), backend="nccl" if cuda else None,
                     timeout=timeout or sizes["timeout"])[0]
