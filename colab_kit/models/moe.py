"""A mixture-of-experts MLP for the built-in GPT: router, top-k, dropless dispatch, capacity, losses, bias.

``MoE(cfg, layer)`` replaces a block's MLP where ``GPTConfig(n_experts=E)`` asks (``moe_blocks``). For each
token ``x`` (``docs/moe.md`` has the whole story)::

    logits = x @ router.weight^T                      [E]    (z-loss reads them)
    p      = softmax(logits) | sigmoid(logits)         scores
    chosen = top_k(p + bias)                           bias: selection only (DeepSeek's aux-loss-free balancing)
    w      = p[chosen] / sum p[chosen]                 renormalised weights
    y      = sum_j w_j expert_{chosen_j}(x) + shared(x)

Ties: ``top_k`` is a stable descending sort, so of equal scores the lower expert index wins, token by token,
whatever the batch layout (``tests/unit/test_moe.py`` routes all-equal scores).

Losses over the whole batch of one process, ``N`` tokens, mean over the model's ``L`` MoE layers:

- balancing (Switch/GShard): ``E * sum_i f_i P_i``, ``f_i`` = assignments to expert ``i`` / ``(N k)`` (before
  any capacity drops), ``P_i`` = mean over tokens of ``p_ti`` (sigmoid scores normalised to sum 1 per token):
  1.0 for a uniform router; times ``cfg.aux_loss``.
- z-loss (ST-MoE): mean over tokens of ``logsumexp(logits)^2``; times ``cfg.z_loss``.

Capacity (``capacity_factor=c``): each expert takes at most ``C = ceil(c k N / E)`` assignments of the batch.
Priority: every first choice before any second choice (slot order), then the batch's token order (row, then
position): ``(token t, slot j)`` to expert ``e`` is kept when fewer than ``C`` assignments to ``e`` come before
it. A dropped assignment adds nothing (its weight is not given to the others); the residual carries the
token. Inside the engine the order runs over the rows of every dp rank (``moe_context``), so the same
assignments are dropped as in one process.

Bias update (``router_bias_update=r``), after each optimizer step (``update_router_bias``)::

    load_i  = assignments to expert i over the step (every microbatch and rank)
    bias_i += r * sign(mean(load) - load_i)          an overloaded expert is chosen less next step
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ConfigError
from .experts import Experts, combine, dispatch
from .layers import MLP
from .moe_context import ONE_PROCESS, AuxLoss, CountedRouter, current

__all__ = ["MoE", "route", "top_k", "balance_loss", "z_loss", "keep_within_capacity", "moe_blocks",
           "moe_loss", "update_router_bias", "has_experts", "check_moe_config"]


def moe_blocks(cfg) -> list[int]:
    """The block indices whose MLP is an MoE layer: every ``moe_every``-th (blocks ``moe_every - 1``,
    ``2 moe_every - 1``, ...); none when ``n_experts == 0``."""
    if not getattr(cfg, "n_experts", 0):
        return []
    return [i for i in range(cfg.n_layers) if (i + 1) % cfg.moe_every == 0]


def top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest ``scores [N, E]`` per row, ties to the lower expert index (a stable sort)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def route(logits: torch.Tensor, k: int, kind: str = "softmax", bias: torch.Tensor | None = None):
    """``(probs [N, E], chosen [N, k], weights [N, k])`` of router ``logits [N, E]``: the scores, the experts
    chosen on ``scores + bias`` and the chosen scores renormalised to sum 1."""
    probs = logits.softmax(-1) if kind == "softmax" else logits.sigmoid()
    chosen = top_k(probs.detach() if bias is None else probs.detach() + bias, k)
    w = probs.gather(1, chosen)
    return probs, chosen, w / w.sum(-1, keepdim=True)


def balance_loss(probs: torch.Tensor, counts: torch.Tensor, tokens, k: int, kind: str = "softmax") -> torch.Tensor:
    """This piece's share of ``E sum_i f_i P_i``: ``counts [E]`` are the whole batch's assignments, ``tokens``
    its tokens (``N``), ``probs`` this piece's rows; summed over the pieces it is the whole batch's loss."""
    if kind == "sigmoid":
        probs = probs / probs.sum(-1, keepdim=True)
    e = probs.shape[-1]
    return e * (counts / (tokens * k) * probs.sum(0)).sum() / tokens


def z_loss(logits: torch.Tensor, tokens) -> torch.Tensor:
    """This piece's share of the mean over the batch's ``tokens`` of ``logsumexp(logits)^2``."""
    return per_token(logits.logsumexp(-1).square().sum(), tokens)


def per_token(x: torch.Tensor, tokens) -> torch.Tensor:
    """``x / tokens`` for ``tokens`` a host int or a 0-dim integer tensor on ``x``'s device (the batch's token
    count, left there so that routing reads nothing to the host). A 16-bit ``x`` is divided in fp32 and rounded
    once, as dividing by a Python int does: a device tensor would be cast to ``x``'s dtype first (bf16 holds
    10,000 as 9,984).

        >>> x = torch.tensor(3.0, dtype=torch.bfloat16)
        >>> torch.equal(per_token(x, 10_000), per_token(x, torch.tensor(10_000))), torch.tensor(10_000).bfloat16()
        (True, tensor(9984., dtype=torch.bfloat16))
    """
    if isinstance(tokens, int) or x.dtype in (torch.float32, torch.float64):
        return x / tokens
    return (x.float() / tokens).to(x.dtype)


def keep_within_capacity(chosen: torch.Tensor, n_experts: int, capacity: int,
                         before: torch.Tensor | None = None, total: torch.Tensor | None = None) -> torch.Tensor:
    """Bool ``[N, k]``: which assignments an expert of ``capacity`` keeps (priority: slot, then token order).
    ``before [k, E]``: assignments of the batch's earlier rows (other ranks) per slot and expert; ``total
    [k, E]``: the whole batch's (None: these rows are the whole batch)."""
    oh = F.one_hot(chosen, n_experts).to(torch.long)  # [N, k, E]
    local = oh.sum(0)  # [k, E]
    total = local if total is None else total
    earlier_slots = total.cumsum(0) - total  # every first choice before any second choice
    rank_here = oh.cumsum(0) - oh  # this slot's assignments to the same expert on earlier local rows
    pos = rank_here + earlier_slots + (before if before is not None else 0)
    return (pos.gather(2, chosen[..., None]).squeeze(2)) < capacity


class MoE(nn.Module):
    """The MoE MLP of block ``cfg``'s MoE layer number ``layer`` (see the module docstring)."""

    def __init__(self, cfg, layer: int = 0):
        super().__init__()
        self.layer, self.n_layers = layer, len(moe_blocks(cfg))
        self.n, self.k, self.kind = cfg.n_experts, cfg.top_k, cfg.router
        self.capacity_factor, self.aux_coef, self.z_coef = cfg.capacity_factor, cfg.aux_loss, cfg.z_loss
        self.bias_rate = cfg.router_bias_update
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.d_expert)
        self.shared = MLP(cfg.d_model, cfg.shared_experts * cfg.d_expert, cfg.dropout) if cfg.shared_experts else None
        self.register_buffer("score_bias", torch.zeros(cfg.n_experts))
        """DeepSeek's per-expert bias, added to the scores for selection only (``update_router_bias``)."""
        self.load = torch.zeros(cfg.n_experts)
        """Assignments per expert since the last bias update (the whole batch's)."""
        self.aux: torch.Tensor | None = None
        """One process: this layer's auxiliary losses of the last forward, with their graph (``moe_loss``)."""
        self.last: dict = {}
        """What the last forward routed: ``counts`` (the batch's, per expert) and ``dropped`` (assignments)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        step = current() or ONE_PROCESS
        logits = self.router(h)
        bias: torch.Tensor = self.score_bias  # type: ignore[assignment]  # a buffer
        probs, chosen, weights = route(logits, self.k, self.kind, bias if self.bias_rate else None)
        cached = step.cache.get(self.layer) if step.inject else None
        first = cached is None
        if cached is None:  # per slot and expert counts and the token count, of every piece of the batch
            local = F.one_hot(chosen, self.n).sum(0)  # int64: exact at any count (bf16 is not past 256)
            mine = torch.cat([local.reshape(-1), torch.full((1,), h.shape[0], dtype=local.dtype, device=local.device)])
            stats = step.gather(mine)
            if step.inject:
                step.cache[self.layer] = stats
        else:
            stats = cached
        per_slot = stats[:, :-1].view(stats.shape[0], self.k, self.n)
        total = per_slot.sum(0)
        tokens: int | torch.Tensor = stats[:, -1].sum()  # left on the device: no host read to route
        counts = total.sum(0).float()
        keep = None
        if self.capacity_factor is not None:
            tokens = int(tokens)  # the capacity is a host number: the one host read, where there is a capacity
            cap = math.ceil(self.capacity_factor * self.k * tokens / self.n)
            keep = keep_within_capacity(chosen, self.n, cap, per_slot[:step.piece].sum(0), total)
        order, got = dispatch(chosen, keep, self.n)
        y = combine(self.experts(h[order // self.k], got), order, weights)
        if self.shared is not None:
            y = y + self.shared(x).reshape(h.shape)  # [batch, seq, d]: its dropout knows the layout
        if self.training and first:
            self.load = self.load.to(counts.device) + counts.detach()
        self.last = {"counts": counts.detach(), "dropped": 0 if keep is None else int((~keep).sum())}
        aux = self._aux(logits, probs, counts, tokens, step.pieces)
        if step.inject and first:  # what the engine records of this layer and microbatch (tensors: no host read)
            step.seen.setdefault(self.layer, {}).update(self._seen(logits, probs, counts, tokens, local, total, keep))
        y = y.view(shape)
        if aux is None or not torch.is_grad_enabled():
            self.aux = aux
            return y
        if step.inject:
            step.values[self.layer] = aux.detach()
            self.aux = None
            return AuxLoss.apply(y, aux, step.grad_scale)
        self.aux = aux
        return y

    @torch.no_grad()
    def _seen(self, logits, probs, counts, tokens, local, total, keep) -> dict:
        """This layer's routing of the microbatch, for the engine's records (``MoEStep.seen``): detached tensors,
        read on the host once per step with every layer's (``expert.records.step_layers``). ``local [k, E]``:
        this rank's assignments per slot and expert; ``tokens`` a host int where there is a capacity (which needs
        it), else a 0-dim tensor on the device."""
        dropped: torch.Tensor | int = 0
        if keep is not None:  # the batch's drops: every assignment past an expert's capacity
            cap = math.ceil(self.capacity_factor * self.k * tokens / self.n)
            dropped = (total.sum(0) - cap).clamp_min(0).sum()
        out = {"counts": total.sum(0), "mine": local.sum(0), "dropped": dropped,
               "balance": balance_loss(probs, counts, tokens, self.k, self.kind), "z": z_loss(logits, tokens)}
        out.update(getattr(self.experts, "traffic", None) or {})  # an expert-parallel layer's bytes per ep rank
        return out

    def _aux(self, logits, probs, counts, tokens, pieces: int = 1):
        """This piece's share of ``(aux_loss * balance + z_loss * z) / L`` times ``pieces`` (the engine reports
        the mean over pieces), or None when both are off."""
        if not self.aux_coef and not self.z_coef:
            return None
        out = logits.new_zeros(())
        if self.aux_coef:
            out = out + self.aux_coef * balance_loss(probs, counts, tokens, self.k, self.kind)
        if self.z_coef:
            out = out + self.z_coef * z_loss(logits, tokens)
        return out * (pieces / self.n_layers)


def moe_loss(model: nn.Module) -> torch.Tensor | float:
    """The auxiliary losses of ``model``'s last forward in one process (summed over its MoE layers, with their
    graph): add it to the loss, ``loss = lm_loss(model(x), y) + moe_loss(model)``; 0.0 when there are none."""
    parts = [m.aux for m in model.modules() if isinstance(m, MoE) and m.aux is not None]
    return sum(parts[1:], parts[0]) if parts else 0.0


@torch.no_grad()
def update_router_bias(model: nn.Module, skip: bool = False) -> None:
    """After an optimizer step: ``bias_i += rate * sign(mean(load) - load_i)`` on every MoE layer with a
    ``router_bias_update`` rate, from the load counted since the last call; the load starts again at zero.
    ``skip``: the step was skipped (an fp16 overflow): the bias stays as the weights do, the load is dropped."""
    for m in model.modules():
        if isinstance(m, MoE):
            bias: torch.Tensor = m.score_bias  # type: ignore[assignment]  # a buffer
            if m.bias_rate and not skip:  # no load counted: every sign is 0 (no host read to ask)
                load = m.load.to(bias.device, bias.dtype)
                bias += m.bias_rate * torch.sign(load.mean() - load)
            m.load = torch.zeros_like(m.load)


def has_experts(model: nn.Module) -> bool:
    """Whether ``model`` holds an MoE layer, or a Hugging Face router counting its load-balancing loss
    (``colab_kit.models.hf_moe``)."""
    return any(isinstance(m, (MoE, CountedRouter)) for m in model.modules())


def check_moe_config(cfg) -> None:
    """``GPTConfig``'s MoE rules, each a ConfigError with the rule and a value that works."""
    if cfg.n_experts < 0:
        raise ConfigError(f"GPTConfig.n_experts={cfg.n_experts}: 0 (a dense MLP) or the number of experts, e.g. 4")
    if not cfg.n_experts:
        return
    if not 1 <= cfg.top_k <= cfg.n_experts:
        raise ConfigError(f"GPTConfig.top_k={cfg.top_k} must be between 1 and n_experts={cfg.n_experts}: "
                          f"try top_k={min(max(cfg.top_k, 1), cfg.n_experts)}")
    if not 1 <= cfg.moe_every <= cfg.n_layers:
        raise ConfigError(f"GPTConfig.moe_every={cfg.moe_every} must be between 1 and n_layers={cfg.n_layers} "
                          f"(block i is MoE when (i + 1) % moe_every == 0): try moe_every=1")
    if cfg.router not in ("softmax", "sigmoid"):
        raise ConfigError(f"GPTConfig.router={cfg.router!r}: 'softmax' or 'sigmoid'")
    if cfg.shared_experts < 0:
        raise ConfigError(f"GPTConfig.shared_experts={cfg.shared_experts} must be 0 or more: try 0 or 1")
    if cfg.d_expert is not None and cfg.d_expert < 1:
        raise ConfigError(f"GPTConfig.d_expert={cfg.d_expert} must be positive: try {cfg.d_ff or 4 * cfg.d_model}")
    if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:
        raise ConfigError(f"GPTConfig.capacity_factor={cfg.capacity_factor} must be positive, or None "
                          "(dropless): try 1.25")
    for name in ("aux_loss", "z_loss", "router_bias_update"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"GPTConfig.{name}={getattr(cfg, name)} must be 0 (off) or positive: try 0.01")
