"""``engine.generate(prompt_ids, max_new_tokens)``: continue prompts with the engine's causal LM.

No KV cache: each new token is one forward of the whole current window, which keeps every
parallel mode's shape rules (and its code) as they are in training. Every rank calls it with
the same prompt ``[b, t]`` and gets the same ``[b, t + max_new_tokens]`` back, equal token for
token to the dense model generating in one process::

    ids = prompt
    for _ in range(max_new_tokens):                  # the one-process loop it equals
        logits = model(ids)[:, -1]                   # [b, V] (a Hugging Face model: .logits)
        ids = torch.cat([ids, pick(logits)], dim=1)

One token, on each rank:

1. the window: the sequences so far, right-padded with token 0 to a fixed length ``T`` (what
   the last forward needs, ``t + max_new_tokens - 1``, rounded up to what the mode splits:
   ``tp`` under split_gather, ``2 sp`` under ring / Ulysses; at most the model's window). Attention
   is causal, so the pad after position ``p`` does not change the logits at ``p``. Rows are padded
   to a multiple of the tensor plan's ``batch_shards``. Every dp rank runs the same rows (no dp split);
2. this rank's share of it, as in training (``TensorPlan.shard_batch``, ``SequencePlan.shard_tokens``),
   through the model: ``engine.module`` or, under pp, the stages in order (below);
3. the logits at the last real position ``p``: under sp the one sp rank holding ``p`` gives its row,
   the others zeros, summed over sp (exact); then all-gathered over the plan's ``vocab_axis`` (the
   vocabulary in rank order) and over its ``batch_axes`` (last axis first, undoing ``shard_batch``):
   every tensor rank holds the full ``[b, V]`` logits;
4. the pick, in fp32 on the CPU: ``argmax`` at ``temperature=0``, else one draw per row from
   ``softmax(logits / temperature)`` with ``torch.multinomial(..., 1, generator=g)``,
   ``g = torch.Generator().manual_seed(seed)`` made once per call;
5. the tokens broadcast over pp from the last stage's rank, then over dp from dp rank 0, so every
   rank appends the very same tokens.

========  ==================  =======================  =====================================
mode      logits [b, T, V]    rows (batch_axes)        gathered for the pick
========  ==================  =======================  =====================================
dp        whole               whole                    nothing
1d, s_g   V over tp           whole                    all_gather over tp (dim -1)
2d        V over tp_col       over tp_row              tp_col (dim -1), then tp_row (dim 0)
2.5d      V over tp_col       over (tp_dep, tp_row)    tp_col, then tp_row, then tp_dep
3d        V over tp_in        over (tp_wt, tp_out)     tp_in, then tp_out, then tp_wt
sp        T over sp (layout)  whole                    the row at p: all_reduce over sp
========  ==================  =======================  =====================================

Pipeline (a forward-only pass, no schedule): each rank runs the stages it holds in stage order;
stage ``s > 0`` takes the hidden states of stage ``s - 1`` from its rank (``comm.irecv`` over "pp",
shape and dtype from a small header sent once per call) or, when that rank is this one (interleaved
or V placements), in memory; the last stage's rank makes the logits. Sends are waited for at the
end of each pass. Worked example, ``pp=2, chunks=2`` (interleaved, stages 0, 2 on rank 0 and
1, 3 on rank 1), one token: rank 0 runs stage 0, sends, receives stage 1's output, runs stage 2,
sends; rank 1 receives, runs stage 1, sends, receives, runs stage 3 -> logits, picks, broadcasts
the tokens over pp.

The model runs in eval mode (dropout off) without gradients, and every module's training flag is
put back afterwards. ZeRO-3 gathers each block's parameters in its forward hooks as in evaluation.
Mixture-of-experts models generate as they train, with expert parallelism too (every rank runs the same
rows: its all-to-all sends them to the experts' ranks). Refused before any collective (``ConfigError`` /
``ValueError``): a model that is not a causal LM (BERT, ViT, a policy with bidirectional attention or a class
loss), an MoE model with a capacity factor (the window's padding would take capacity), a prompt that is not a 2-D
integer tensor with ids in the vocabulary, longer than the model's window, a ``max_new_tokens`` that
is negative or makes the last forward longer than the window, a negative temperature, a pipeline
step in progress or broken.
"""
from __future__ import annotations

import math
import zlib

import torch

from .. import comm
from .agree import agree_on_batch
from ..config import Axis, ConfigError
from ..models import BERTConfig, GPTConfig, ViTConfig
from ..sequence.zigzag import sequence_positions

__all__ = ["generate", "pick_tokens"]

_TAG = 0x3A000000
"""Backend tag base of generation's pipeline messages (``| 1 << 20`` for the shape headers; ``| s``: the
stage that sent it). No training step runs during generation, so they never meet a step's messages."""
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def generate(engine, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0) -> torch.Tensor:
    """``prompt_ids [b, t]`` continued by ``max_new_tokens`` tokens, ``[b, t + max_new_tokens]`` on every
    rank (on the prompt's device); see the module docstring for what each rank does."""
    settings = torch.tensor([zlib.crc32(repr((max_new_tokens, temperature, seed)).encode())])
    agree_on_batch((prompt_ids, settings), engine.mesh, False, "generate",  # before any check a rank makes alone
                   rule="every rank passes the same prompts, max_new_tokens, temperature and seed (each rank picks "
                        "the same tokens by the same draw)", names=("prompt_ids", "the settings"))
    ids, window = check(engine, prompt_ids, max_new_tokens, temperature, seed)
    if max_new_tokens == 0:
        return ids.to(prompt_ids.device)
    modes = [(m, m.training) for m in engine.module.modules()]
    engine.module.eval()
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    shapes: dict = {}  # pipeline: the hidden states' (shape, dtype) per stage boundary, learnt once
    ring = getattr(engine.sp_plan, "recorder", None)  # the last training step's rotations stay what it shows
    kept = list(ring.events) if ring is not None else None
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logits = _last_logits(engine, ids, window, shapes)  # [b, V] fp32 on the CPU, or None
                tok = torch.zeros(ids.shape[0], dtype=torch.int64) if logits is None else \
                    pick_tokens(logits, temperature, gen)
                ids = torch.cat([ids, _share(engine, tok).unsqueeze(1)], dim=1)
    finally:
        for m, training in modes:
            m.training = training
        if ring is not None:
            ring.events[:] = kept
    return ids.to(prompt_ids.device)


def pick_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row of ``logits [b, V]``: argmax at temperature 0, else one draw from
    ``softmax(logits / temperature)`` (fp32, CPU) with ``generator`` (one process does the same)."""
    logits = logits.float().cpu()
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


# ---------------------------------------------------------------------- checks (no collective)
def check(engine, prompt_ids, max_new_tokens, temperature, seed) -> tuple[torch.Tensor, int]:
    """The prompt as int64 on the CPU and the window length ``T``; ConfigError / ValueError before
    any collective for what generation cannot run."""
    if engine.closed:
        raise RuntimeError("this engine was closed (engine.close()): boost a new one to generate")
    _check_causal(engine)
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dtype in (torch.bool,) or \
            prompt_ids.dtype.is_floating_point or prompt_ids.dtype.is_complex:
        what = f"a tensor of {prompt_ids.dtype}" if isinstance(prompt_ids, torch.Tensor) else type(prompt_ids).__name__
        raise ValueError(f"prompt_ids must be an integer tensor of token ids [batch, tokens], got {what}: "
                         f"e.g. torch.tensor([[3, 7, 1]])")
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] == 0 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be [batch, tokens] with at least one row and one token, got shape "
                         f"{tuple(prompt_ids.shape)}: a single prompt is prompt[None]")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not \
            math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    ids = prompt_ids.detach().to("cpu", torch.int64)
    vocab = _model_field(engine, "vocab_size")
    if vocab is not None and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"prompt_ids holds ids {int(ids.min())}..{int(ids.max())}, outside the vocabulary "
                         f"0..{vocab - 1}")
    pipe = engine.pipeline
    if pipe is not None and pipe.running:
        raise RuntimeError("a pipeline step is running: finish() it before generate()")
    if pipe is not None and pipe.broken is not None:
        raise RuntimeError(f"this pipeline runs no more passes ({pipe.broken}): restart the ranks and boost again")
    return ids, _window(engine, ids.shape[1], max_new_tokens)


def _check_causal(engine) -> None:
    cfg, policy = engine.model_cfg, engine.policy
    if isinstance(cfg, GPTConfig):
        if getattr(cfg, "n_experts", 0) and cfg.capacity_factor is not None:
            raise ConfigError(f"generate() pads each window to a fixed length, and capacity_factor="
                              f"{cfg.capacity_factor} would count the padding among the tokens an expert takes "
                              "(dropping real ones one process keeps): generate with the same weights in a model "
                              "built with capacity_factor=None (dropless; ck.dense_state_dict(engine) gives them), "
                              "or in one process")
        return
    known = ("colab_kit.models.GPT, transformers' GPT2LMHeadModel, LlamaForCausalLM (and Mistral, Qwen2, Qwen3) or "
             "an MoE causal LM of colab_kit.policy.hf_moe, or a model whose policy "
             "has causal attention and loss='tokens'")
    if isinstance(cfg, (BERTConfig, ViTConfig)):
        raise ConfigError(f"generate() continues the prompts of a causal language model ({known}); "
                          f"{type(cfg).__name__[:-6]} is not one: evaluate it with engine.evaluate(batch)")
    if policy is None:  # nothing says what the model is
        raise ConfigError(f"generate() continues the prompts of a causal language model ({known}); "
                          f"{type(_root(engine)).__name__} has no policy that says it is one: pass ck.boost(..., "
                          f"policy=Policy(..., attention={{...: Attention(causal=True)}}, loss='tokens'))")
    atts = list(policy.attention.values())
    if policy.loss != "tokens" or not policy.sequence or not atts or not all(a.causal for a in atts):
        why = "bidirectional attention" if not all(a.causal for a in atts) else \
            f"loss={policy.loss!r}" if policy.loss != "tokens" else "no attention it names"
        raise ConfigError(f"generate() needs a causal language model; policy {policy.name or '?'!r} has {why}: "
                          f"evaluate it with engine.evaluate(batch)")


def _root(engine):
    """The model as this rank holds it: ``engine.module``, or under pp a stage's shell of it."""
    if engine.pipeline is None:
        return engine.module
    return next(iter(engine.pipeline.stages.values())).model


def _model_field(engine, name: str):
    """``vocab_size`` or ``window`` of the dense model: the built-in config's, else a Hugging Face config's."""
    cfg = engine.model_cfg
    if cfg is not None:
        return getattr(cfg, "seq_len" if name == "window" else name, None)
    hf = getattr(_root(engine), "config", None)
    keys = ("n_positions", "max_position_embeddings") if name == "window" else (name,)
    return next((getattr(hf, k) for k in keys if isinstance(getattr(hf, k, None), int)), None)


def _window(engine, t: int, max_new_tokens: int) -> int:
    """The fixed length every forward of this call runs: what the last one needs, rounded up to the
    multiple the mode splits the sequence by, at most the model's window."""
    cfg = engine.config
    mult = math.lcm(cfg.tp if cfg.sp_mode == "split_gather" and cfg.tp > 1 else 1, 2 * cfg.sp if cfg.sp > 1 else 1)
    limit = _model_field(engine, "window")
    need = t + max(max_new_tokens, 1) - 1
    if limit is not None and t > limit:
        raise ValueError(f"a prompt of {t} tokens is longer than the model's window of {limit} tokens: "
                         f"keep its last {limit} tokens or fewer")
    if limit is not None and need > limit:
        raise ValueError(f"{t} prompt tokens + {max_new_tokens} new ones need a last forward of {need} tokens, "
                         f"more than the model's window of {limit}: ask for at most {limit - t + 1} new tokens")
    window = -(-need // mult) * mult
    if limit is not None and window > limit:
        raise ConfigError(f"a window of {need} tokens rounds up to {window} to split over {cfg.describe()}, more "
                          f"than the model's {limit}: use a prompt and max_new_tokens that need at most "
                          f"{limit // mult * mult} tokens")
    return window


# ---------------------------------------------------------------------- one token
def _last_logits(engine, ids: torch.Tensor, window: int, shapes: dict) -> torch.Tensor | None:
    """The full-vocabulary logits ``[b, V]`` (fp32, CPU) at the last position of ``ids``; None on a
    pipeline rank that does not hold the last stage."""
    b, t = ids.shape
    plan, sp = engine.tp_plan, engine.sp_plan
    shards = plan.batch_shards if plan is not None else 1
    x = torch.zeros(-(-b // shards) * shards, window, dtype=torch.int64)
    x[:b, :t] = ids
    if plan is not None:
        x = plan.shard_batch(x)
    if sp is not None:
        x = sp.shard_tokens(x)
    x = x.to(engine.mesh.device)
    out = engine.parts.logits(engine.module(x)) if engine.pipeline is None else _pipeline_forward(engine, x, shapes)
    if out is None:
        return None
    return _gather_logits(engine, out, t - 1, window)[:b].float().cpu()


def _gather_logits(engine, logits: torch.Tensor, pos: int, window: int) -> torch.Tensor:
    """Local logits ``[b_local, T_local, V_local]`` -> the full ``[b_padded, V]`` at global position ``pos``."""
    mesh, plan, sp = engine.mesh, engine.tp_plan, engine.sp_plan
    if sp is None:
        row = logits[:, pos]
    else:  # the sp rank holding position pos gives its row, the others zeros: the sum is that row exactly
        where = (sequence_positions(sp.rank, sp.size, window, sp.layout) == pos).nonzero().flatten().tolist()
        row = logits[:, where[0]].contiguous() if where else logits.new_zeros(logits[:, 0].shape)
        comm.all_reduce(row, mesh, sp.axis, tag="generate logits")
    if plan is not None:
        row = comm.all_gather(row, mesh, plan.vocab_axis, dim=-1, tag="generate logits")
        for axis in reversed(plan.batch_axes):  # shard_batch splits the slowest axis first
            row = comm.all_gather(row, mesh, axis, dim=0, tag="generate logits")
    return row


def _share(engine, tok: torch.Tensor) -> torch.Tensor:
    """The tokens the last stage picked on every rank: broadcast over pp from it, then over dp from 0."""
    mesh = engine.mesh
    t = tok.to(mesh.device)
    if engine.pipeline is not None:
        plan = engine.pipeline.plan
        comm.broadcast(t, mesh, Axis.PP, src=plan.rank_of(plan.n_stages - 1), tag="generate tokens")
    comm.broadcast(t, mesh, Axis.DP, src=0, tag="generate tokens")
    return t.cpu()


# ---------------------------------------------------------------------- pipeline
def _pipeline_forward(engine, x: torch.Tensor, shapes: dict) -> torch.Tensor | None:
    """One forward through the stages, in stage order; the logits on the last stage's rank, else None."""
    pipe = engine.pipeline
    plan, me, mesh = pipe.plan, pipe.me, engine.mesh
    n, h, out, sends = plan.n_stages, None, None, []
    for s in range(n):
        st = pipe.stages.get(s)
        if st is None:
            continue
        if s > 0 and plan.rank_of(s - 1) != me:  # else h is stage s - 1's output, made here just before
            h = _recv(engine, plan.rank_of(s - 1), s - 1, shapes, pipe.timeout)
        h = st(x if s == 0 else h, x)
        if s == n - 1:
            out = h
        elif plan.rank_of(s + 1) != me:
            peer = plan.rank_of(s + 1)
            if s not in shapes:
                shapes[s] = (tuple(h.shape), h.dtype)
                header = torch.tensor([_DTYPES.index(h.dtype), h.dim(), *h.shape] + [0] * (6 - h.dim()),
                                      dtype=torch.int64, device=mesh.device)
                sends.append(comm.isend(header, mesh, Axis.PP, peer, msg_tag=_TAG | 1 << 20 | s, tag="generate shape"))
            sends.append(comm.isend(h.contiguous(), mesh, Axis.PP, peer, msg_tag=_TAG | s, tag="generate hidden"))
    for pending in sends:
        pending.wait(pipe.timeout)
    return out


def _recv(engine, peer: int, s: int, shapes: dict, timeout: float) -> torch.Tensor:
    """Stage ``s``'s output from pipeline rank ``peer`` (its shape header first, once per call)."""
    mesh = engine.mesh
    if s not in shapes:
        header = torch.zeros(8, dtype=torch.int64, device=mesh.device)
        comm.irecv(header, mesh, Axis.PP, peer, msg_tag=_TAG | 1 << 20 | s, tag="generate shape").wait(timeout)
        h = header.tolist()
        shapes[s] = (tuple(h[2:2 + h[1]]), _DTYPES[h[0]])
    shape, dtype = shapes[s]
    buf = torch.empty(shape, dtype=dtype, device=mesh.device)
    comm.irecv(buf, mesh, Axis.PP, peer, msg_tag=_TAG | s, tag="generate hidden").wait(timeout)
    return buf
