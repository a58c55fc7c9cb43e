"""The analytic side: bytes per parameter by precision, optimizer states, the ZeRO paper's model-state
formulas stage by stage, where offload places them, and a count of what each transformer op saves for
backward. ``colab_kit.memory.estimator`` builds the per-config estimate on these."""
from __future__ import annotations

import torch

from .saves import BlockSaves

__all__ = ["estimate", "model_state_bytes", "activation_bytes", "optimizer_states", "placed", "PRECISION_BYTES",
           "OPTIMIZER_STATES", "recompute_mode"]


PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of one parameter (and of its gradient) in each precision."""
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "sgd-momentum": 1, "sgd-nomomentum": 0}
"""fp32 state tensors an optimizer keeps per parameter: Adam's m and v, SGD's momentum buffer."""


def optimizer_states(optimizer) -> int:
    """fp32 states per parameter of ``optimizer``: a name of ``OPTIMIZER_STATES``, or a torch
    optimizer (Adam and AdamW 2; SGD 1 with momentum, 0 without)."""
    if isinstance(optimizer, str):
        if optimizer.lower() not in OPTIMIZER_STATES:
            raise ValueError(f"unknown optimizer {optimizer!r}: choose one of {', '.join(OPTIMIZER_STATES)}")
        return OPTIMIZER_STATES[optimizer.lower()]
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 2
    if isinstance(optimizer, torch.optim.SGD):
        return int(any(group.get("momentum", 0) for group in optimizer.param_groups))
    raise ValueError(f"no state count known for {type(optimizer).__name__}: pass 'adamw', 'sgd' or 'sgd-nomomentum'")


def model_state_bytes(n_params: int, optimizer="adamw", precision: str = "fp32", dp: int = 1,
                      zero: int = 0, offload: str = "none") -> dict:
    """Bytes per rank of params, grads and optimizer states: the ZeRO paper's formulas.

    ``n_params`` is Psi, the parameters this rank holds before ZeRO (already divided by tp and pp); N = ``dp``
    (the ranks ZeRO shards over: ``ParallelConfig.zero_ranks``, dp x sp). A parameter and its gradient take 2
    bytes in bf16/fp16, 4 in fp32; the optimizer takes K bytes per parameter: 4 per fp32 state, plus 4 for the
    fp32 master copy under mixed precision (Adam: K = 8 in fp32, 12 mixed; SGD with momentum: 4 and 8). Stage 1
    shards the optimizer over dp, stage 2 the gradients too, stage 3 the parameters too (a shard is ceil(Psi / N)
    parameters).

    ``offload="cpu"`` with stage 1 or 2 in fp32 adds the fp32 copy of this rank's piece that the
    host steps (K + 4: ZeRO-Offload keeps the parameters on the device for compute and their
    fp32 master on the host; under mixed precision that master is already in K). Stage 3 keeps
    its shard itself on the host: the formulas do not change, only where the bytes live
    (``placed``).

    >>> model_state_bytes(1000, "adamw", "fp32", dp=4, zero=2)    # 4 Psi + 12 Psi / N
    {'params': 4000, 'grads': 1000, 'optimizer': 2000}
    >>> model_state_bytes(1000, "adamw", "fp32", dp=4, zero=1, offload="cpu")["optimizer"]  # (8 + 4) Psi / N
    3000
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISION_BYTES)}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {zero!r}")
    b = PRECISION_BYTES[precision]
    k = 4 * optimizer_states(optimizer) + (4 if b < 4 or (offload != "none" and zero in (1, 2)) else 0)
    shard = -(-n_params // dp)
    return {"params": b * (shard if zero >= 3 else n_params),
            "grads": b * (shard if zero >= 2 else n_params),
            "optimizer": k * (shard if zero >= 1 else n_params)}


def placed(est: dict, zero: int = 0, offload: str = "none", host_share: float | None = None) -> dict:
    """``est`` (the categories of ``estimate``) with where they live: ``{**est, "device": {...},
    "host": {...}}``. ``offload="cpu"``: stage 1/2's optimizer (states and fp32 copies) on the
    host; stage 3's params, grads and optimizer all on the host. ``"auto"``: ``host_share`` of
    stage 3's model states on the host (the placement's share of chunk elements). Activations
    live on the device.

    >>> placed({"params": 10, "grads": 10, "optimizer": 20, "activations": 5}, 3, "cpu")["device"]
    {'params': 0, 'grads': 0, 'optimizer': 0, 'activations': 5}
    """
    host = dict.fromkeys(est, 0)
    if offload == "cpu" and zero in (1, 2):
        host["optimizer"] = est["optimizer"]
    elif offload in ("cpu", "auto") and zero == 3:
        share = 1.0 if offload == "cpu" else (host_share or 0.0)
        for k in ("params", "grads", "optimizer"):
            host[k] = int(round(est[k] * share))
    return {**est, "device": {k: est[k] - host[k] for k in est}, "host": host}


def auto_placed(est: dict, budget: int) -> dict:
    """``offload="auto"`` (ZeRO-3 chunks placed under a device budget) as ``placed`` puts it: the model states
    that do not fit beside the activations in ``budget`` bytes go to the host, in proportion (the placement
    moves whole chunks; the estimate takes their share).

    >>> auto_placed({"params": 10, "grads": 10, "optimizer": 20, "activations": 5}, 25)["host"]
    {'params': 5, 'grads': 5, 'optimizer': 10, 'activations': 0}
    """
    states = est["params"] + est["grads"] + est["optimizer"]
    room = max(0, budget - est["activations"])
    share = 0.0 if states <= room else 1.0 - room / states
    out = placed({k: est[k] for k in ("params", "grads", "optimizer", "activations")}, 3, "auto", share)
    over = min(sum(out["device"].values()) - budget, out["device"]["optimizer"]) if share else 0
    if over > 0:  # each category's share was rounded: the host takes the last bytes, the device stays in budget
        out["host"]["optimizer"] += over
        out["device"]["optimizer"] -= over
    return out


def host_share(memory: dict) -> float:
    """The share of the model states ``memory`` (``placed``'s) keeps on the host."""
    keys = ("params", "grads", "optimizer")
    total = sum(memory[k] for k in keys)
    return sum(memory["host"][k] for k in keys) / total if total else 0.0


def recompute_mode(recompute) -> str:
    """``recompute`` as "none", "selective", "op" or "full" (True / False: "full" / "none"), as
    ``ParallelConfig`` keeps it."""
    if recompute is True or recompute is False:
        return "full" if recompute else "none"
    if recompute not in ("none", "selective", "op", "full"):
        raise ValueError(f"recompute must be 'none', 'selective', 'op' or 'full' (or True / False), got {recompute!r}")
    return recompute


def activation_bytes(model, rows: int, *, seq: int | None = None, layers: int | None = None, first: bool = True,
                     last: bool = True, tp: int = 1, recompute: bool | str = False, bytes_per_elem: int = 4,
                     sequence_split: int = 1, saves: BlockSaves | None = None) -> dict:
    """Bytes autograd saves in one forward of ``rows`` sequences through a ``ck.models.GPT``
    (``model`` is its ``GPTConfig``) on one rank: what ``ActivationMeter`` measures.

    ``layers`` blocks run here (all by default); ``first`` / ``last``: this rank has the
    embeddings / the final LayerNorm, head and loss (pipeline stages). ``tp``: 1D tensor
    parallelism, which splits q, k, v, the attention output and the MLP's inner activations.
    Counted per block, N = rows * seq tokens, e = ``bytes_per_elem``, what GPT's ops save:

    ============================  ==================================  ======================
    op                            saves                               bytes
    ============================  ==================================  ======================
    ln1, ln2 (LayerNorm)          input; mean and 1/std               2 (e N h + 2 e N)
    qkv, fc1 (Linear)             its input (the LayerNorm's output)  2 e N h
    scaled_dot_product_attention  q, k, v (one tensor), output        4 e N h / tp
                                  log-sum-exp, fp32, per head         4 N a / tp
    proj (Linear)                 its input: the attention output     0 (counted above)
    gelu, fc2                     fc1's output, gelu's output         2 e N f / tp
    ============================  ==================================  ======================

    With ``recompute`` True or "full" a block saves only its input (e N h); in backward one block at a
    time is rebuilt, so the peak in backward is ``held`` plus one block's worth (``peak``). With
    "selective" (``colab_kit.recompute.selective``) attention's core runs under a checkpoint: its inputs
    q, k, v stay (the checkpoint holds them), its output stays (``proj`` saves it: the same storage),
    and what the core alone kept goes, the log-sum-exp, ``4 N a / tp`` a block; in backward one core at a
    time is rebuilt (``peak``). That is Korthikanti et al.'s ``5 a s / h`` term of ``s b h (34 + 5 a s / h)``
    in this engine: their scores, softmax and dropout mask (``5 a s^2 b`` bytes in 16 bits) are never kept by
    the fused kernel, whose only own tensor is the log-sum-exp; eager attention (a Hugging Face model
    with attention dropout) keeps the scores, probabilities and mask, and selective drops those. With "op"
    (``colab_kit.recompute.op``: per-op selective checkpointing) a block keeps its input (e N h, split as
    full's), the outputs of every second matmul (qkv's, 3 e N h / tp, and fc1's, e N f / tp) and of the
    attention kernel (its output e N h / tp and log-sum-exp 4 N a / tp); in backward one block at a time
    recomputes the rest (``peak``). The
    embeddings save the token ids (8 N) and positions (8 seq); the last stage saves ln_f's
    input and statistics, the head's input (e N (2h) + 8 N), the log-softmax (4 N V / tp: fp32)
    and the targets (8 N) with the loss's weight (4). The meter counts a tensor's whole storage:
    the token ids and targets of a microbatch that is a slice of a larger batch count as that
    batch (the estimate counts N).
    1D tensor parallelism is estimated for the blocks; its vocabulary-parallel embedding and
    loss save a little more than the dense ones. ``sequence_split``: split_gather (Megatron's
    sequence parallelism in the tp group) keeps each LayerNorm's input and statistics split
    along the sequence over that many ranks; the rest is 1D's. ``saves``: another architecture's block
    (``memory.saves.BlockSaves``: a Hugging Face Llama's RMSNorm in fp32, SwiGLU, grouped-query attention, q/k
    norms, rotary tables); the GPT's by default, the table above.

    >>> from colab_kit.models import GPTConfig
    >>> a = activation_bytes(GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2), 8)
    >>> a["block"], a["held"], a["peak"] == a["held"]
    (1056768, 2316548, True)
    """
    saves = saves or BlockSaves.of_gpt(model)
    seq = model.seq_len if seq is None else seq
    layers = model.n_layers if layers is None else layers
    n, e = rows * seq, bytes_per_elem
    mode = recompute_mode(recompute)
    block = saves.block(n, e, tp, sequence_split)
    core = saves.core(n, tp)  # what attention's core alone keeps: the log-sum-exp (fp32)
    x = e * n * saves.hidden // sequence_split  # the block's input (split_gather: split too)
    op = saves.op_kept(n, e, tp, sequence_split)  # + every second matmul's and the attention kernel's outputs
    kept = {"full": x, "op": op, "selective": block - core, "none": block}[mode]
    embed = 8 * n + 8 * seq if first else 0
    head = saves.head(n, e, tp, sequence_split) if last else 0
    held = layers * kept + embed + head + (saves.rope(seq, e) if layers and mode in ("none", "selective") else 0)
    return {"block": block, "blocks": layers * kept, "embedding": embed, "head": head, "held": held,
            "peak": held + ({"full": block, "op": block - op + x, "selective": core, "none": 0}[mode] if layers else 0)}


def estimate(n_params: int, optimizer="adamw", bytes_per_param: int | None = None, dp: int = 1, zero: int = 0,
             *, precision: str | None = None, model=None, rows: int = 0, recompute: bool | str = False, tp: int = 1,
             layers: int | None = None, first: bool = True, last: bool = True, offload: str = "none",
             seq: int | None = None, sequence_split: int = 1) -> dict:
    """Estimated bytes per rank in the categories ``engine.memory()`` measures.

    params, grads, optimizer: ``model_state_bytes`` (the ZeRO paper's formulas, Psi =
    ``n_params`` on this rank, N = ``dp``); ``precision`` 'bf16' or 'fp16' (or
    ``bytes_per_param=2``) is mixed precision with fp32 master weights. activations:
    ``activation_bytes(model, rows, ...)["held"]`` when a ``GPTConfig`` is given (``rows`` per
    microbatch on this rank), else 0.

    Worked example, Psi = 1,000,000 parameters on a rank, N = dp = 4, Adam (bytes per rank, M = 10^6):

    =========  ===================  ============================  ===========================
    stage      fp32 (16 Psi)        bf16 / fp16 (K = 12)          SGD + momentum, fp32 (K = 4)
    =========  ===================  ============================  ===========================
    0          4 + 4 + 8 = 16 M     2 + 2 + 12 = 16 M             4 + 4 + 4 = 12 M
    1          4 + 4 + 2 = 10 M     2 + 2 + 3 = 7 M               4 + 4 + 1 = 9 M
    2          4 + 1 + 2 = 7 M      2 + 0.5 + 3 = 5.5 M           4 + 1 + 1 = 6 M
    3          1 + 1 + 2 = 4 M      0.5 + 0.5 + 3 = 4 M           1 + 1 + 1 = 3 M
    =========  ===================  ============================  ===========================

    >>> estimate(1000, "adamw")
    {'params': 4000, 'grads': 4000, 'optimizer': 8000, 'activations': 0}
    >>> estimate(1_000_000, "adamw", dp=4, zero=2, precision="bf16")
    {'params': 2000000, 'grads': 500000, 'optimizer': 3000000, 'activations': 0}
    """
    if precision is None:
        precision = {4: "fp32", 2: "bf16"}.get(4 if bytes_per_param is None else bytes_per_param)
        if precision is None:
            raise ValueError(f"bytes_per_param must be 4 (fp32) or 2 (bf16/fp16), got {bytes_per_param}")
    elif bytes_per_param is not None and bytes_per_param != PRECISION_BYTES.get(precision):
        raise ValueError(f"precision={precision!r} keeps {PRECISION_BYTES.get(precision)} bytes per parameter, "
                         f"not bytes_per_param={bytes_per_param}: give one of them")
    out = model_state_bytes(n_params, optimizer, precision, dp, zero, offload)
    acts = 0
    if model is not None and rows:
        acts = activation_bytes(model, rows, seq=seq, layers=layers, first=first, last=last, tp=tp, recompute=recompute,
                                sequence_split=sequence_split,
                                bytes_per_elem=PRECISION_BYTES[precision])["held"]
    out["activations"] = acts
    return out
