"""The load-balancing loss of a Hugging Face mixture-of-experts model, over the whole batch inside the engine.

``transformers``' MoE causal LMs (Mixtral, Qwen3-MoE, OLMoE, ...) with ``output_router_logits=True`` report
``loss = CE + router_aux_loss_coef * aux``, where ``load_balancing_loss_func`` concatenates the router logits
of all ``L`` MoE layers over the ``N`` tokens of the batch::

    p_t     = softmax(logits_t)                 per token and layer, [E]
    C_e     = top-k assignments to expert e     over every layer and token (sum_e C_e = N L k)
    P_e     = sum of p_te                       over every layer and token
    aux     = E * sum_e (C_e / (N L)) * (P_e / (N L))

Unlike the built-in MoE (a loss per layer), the counts of all layers multiply each layer's probabilities. Inside
the engine a rank sees its rows only, so ``router_loss`` makes each router a subclass that, under the engine's
``MoEStep`` (``moe_context``), gathers its layer's counts and token count over the ranks holding the
microbatch's tokens (dp x sp; once per layer and microbatch, cached for a recomputed forward) and puts
``RouterAux`` on the router's top-k weights. The counts are not differentiable and the loss is linear in ``P``
given them, so the gradient a rank's own ``P^r`` needs is ``coef * E * C / (N L)^2``, which ``RouterAux``
injects in backward: by then every layer's forward has run, so ``C`` (summed over the layers' gathered counts)
is known. Each rank reports ``pieces * coef * E * (C . P^r_l) / (N L)^2`` per layer (``MoEStep.values``); the
engine's mean over ranks is the one process's ``coef * aux``.

Worked example, dp=2, 2 MoE layers, 4 experts, top-2, 8 tokens per rank: rank 0's layer 0 counts
``[5 3 4 4]`` of 8 tokens; the gather gives both ranks' ``[[5 3 4 4 | 8], [2 6 4 4 | 8]]``; after the forward
``C`` sums both layers over both ranks (``N = 16``, ``N L k = 64``) and rank 0's layer 0 receives the
gradient ``coef * 4 * C / 32^2`` on its own probability sums.

Under a pipeline a stage's backward needs the counts of layers on other stages: ``CountsRelay`` (the
pipeline's ``Sideband``) sends each microbatch's known counts with every activation to the next stage and
with every input gradient back, one ``[L, E + 2]`` message beside each. A stage's backward of a microbatch
waits for the gradient of the stage after it, which has seen the whole forward, so every layer's counts
have arrived by then. Worked example, pp=2, 2 MoE layers, one per stage: stage 0 sends its layer 0 counts
with the activation (row 0 known); stage 1 adds its layer 1 and sends both rows back with the gradient; stage
0's backward then sums both layers, as one process does. Outside the engine (no ``MoEStep``) the routers are
the model's own: one process still computes HF's loss itself. Inside, the model's forward runs with
``output_router_logits=False`` (``engine_call``): HF's loss over one rank's rows would go unused.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .moe import balance_loss, z_loss
from .moe_context import CountedRouter, MoEStep, current

__all__ = ["router_loss", "RouterLoss", "RouterAux", "aux_coef", "routers", "CountsRelay",
           "engine_call"]


class RouterLoss(CountedRouter):
    """Base of the router subclasses ``router_loss`` makes: its layer number ``layer`` of ``layers``, the
    experts ``n`` and ``k`` of HF's loss and its ``coef`` (``models.moe.has_experts`` recognises it)."""

    layer: int = 0
    layers: int = 1
    n: int = 1
    k: int = 1
    coef: float = 0.0


def aux_coef(model: nn.Module) -> float:
    """The coefficient HF's forward adds the load-balancing loss with: ``router_aux_loss_coef`` when the
    config asks for router logits (``output_router_logits``) and the causal LM adds the loss, else 0."""
    cfg = getattr(model, "config", None)
    if cfg is None or not getattr(cfg, "output_router_logits", False) or not hasattr(model, "router_aux_loss_coef"):
        return 0.0
    coef: float = model.router_aux_loss_coef  # type: ignore[assignment]  # a float, not a submodule
    return float(coef)


def routers(model: nn.Module, paths) -> list[nn.Module]:
    """The router (``gate``, GPT-OSS's ``router``) of each MoE layer at ``paths`` (the policy's ``experts``), in
    layer order."""
    mlps = [model.get_submodule(p) for p in paths]
    return [m.get_submodule("gate" if "gate" in m._modules else "router") for m in mlps]


def router_loss(model: nn.Module, paths, n_experts: int, top_k: int) -> None:
    """Make each router of the MoE layers at ``paths`` a ``RouterLoss`` subclass of its own class (in place:
    same parameters and state-dict keys), counting HF's load-balancing loss over the whole batch. Idempotent;
    nothing to do when the model does not add the loss (``aux_coef`` 0)."""
    coef = aux_coef(model)
    if not coef:
        return
    found = routers(model, paths)
    for i, r in enumerate(found):
        if not isinstance(r, RouterLoss):
            r.__class__ = _derived(type(r))
        vars(r).update(layer=i, layers=len(found), n=n_experts, k=top_k, coef=coef)  # plain attributes
    if engine_call not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(engine_call, with_kwargs=True)


def engine_call(model: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a counted model (``router_loss``): under the engine's ``MoEStep`` its forward runs with
    ``output_router_logits=False`` (unless the call says otherwise). HF's forward would else record every
    layer's router logits and compute ``load_balancing_loss_func`` over this rank's rows alone, a value the
    engine never reads (the routers count the loss over the whole batch). The config is left as it is
    (``aux_coef`` reads it), and outside the engine (no ``MoEStep``) the model computes HF's loss as before."""
    if current() is None:
        return None
    return args, {"output_router_logits": False, **kwargs}


_MADE: dict[type, type] = {}


def _derived(cls: type) -> type:
    if cls not in _MADE:
        _MADE[cls] = type("Counted" + cls.__name__, (RouterLoss, cls),
                          {"forward": _counted_forward, "__module__": __name__, "__doc__": RouterLoss.__doc__})
        globals().setdefault(_MADE[cls].__name__, _MADE[cls])  # pickle finds it by reference
    return _MADE[cls]


def _counted_forward(self, hidden_states):
    logits, scores, index = super(RouterLoss, self).forward(hidden_states)
    step = current()
    if step is None or not step.inject or not torch.is_grad_enabled():
        return logits, scores, index
    probs = logits.softmax(-1)  # as load_balancing_loss_func: softmax of the logits, top-k of those
    if self.layer not in step.cache:
        chosen = torch.topk(probs.detach(), self.k, dim=-1).indices
        flat = chosen.reshape(-1)  # counted by index_add (a CUDA bincount reads its size on the host)
        local = torch.zeros(self.n, dtype=torch.float32, device=flat.device).index_add_(
            0, flat, torch.ones(flat.shape, dtype=torch.float32, device=flat.device))
        n = torch.full((1,), probs.shape[0], dtype=local.dtype, device=local.device)  # fp32: exact up to 2^24
        stats = step.cache[self.layer] = step.gather(torch.cat([local, n]))
        step.seen[self.layer] = _seen(self, logits.detach(), probs.detach(), local, stats)
    return logits, RouterAux.apply(scores, probs.sum(0), step, self), index


def _seen(router: RouterLoss, logits, probs, local, stats) -> dict:
    """This layer's routing of the microbatch for the engine's records (``expert.records``), as the built-in
    MoE writes it: whole-batch ``counts``, this rank's ``mine``, and this rank's shares of the layer's Switch
    balance ``E sum_i f_i P_i`` (1.0 uniform; HF's own loss is the all-layer form above) and z-loss; detached
    tensors, read on the host once per step (``step_layers``, which also multiplies the shares by ``pieces``)."""
    counts, tokens = stats[:, :-1].sum(0), stats[:, -1].sum()
    return {"counts": counts, "mine": local, "dropped": 0,
            "balance": balance_loss(probs.float(), counts, tokens, router.k), "z": z_loss(logits.float(), tokens)}


class RouterAux(torch.autograd.Function):
    """``RouterAux.apply(scores, psum, step, router)`` returns ``scores``; in backward ``psum`` (this rank's
    probability sums of the router's layer, ``[E]``) receives ``grad_scale * pieces * coef * E * C / (N L)^2``,
    ``C`` the whole batch's counts over every layer (``step.cache``), and the layer's share of the loss is
    written to ``step.values`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, scores, psum, step: MoEStep, router: RouterLoss):
        ctx.save_for_backward(psum)
        ctx.step, ctx.router = step, router
        return scores.view_as(scores)

    @staticmethod
    def backward(ctx, grad):
        (psum,) = ctx.saved_tensors
        step, r = ctx.step, ctx.router
        if len(step.cache) != r.layers:
            raise RuntimeError(f"the load-balancing loss needs the counts of all {r.layers} MoE layers at backward, "
                               f"and {len(step.cache)} are known here: a pipeline's messages bring the others "
                               "(CountsRelay as the step's sideband)")
        stats = torch.stack([step.cache[i].sum(0) for i in range(r.layers)])  # [L, E + 1]: summed over the pieces
        counts, tokens = stats[:, :-1].sum(0), stats[0, -1]
        per_p = step.pieces * r.coef * r.n * counts / (tokens * r.layers) ** 2
        step.values[r.layer] = (per_p * psum.detach().float()).sum()
        return grad, (step.grad_scale * per_p).to(psum.dtype), None, None


class CountsRelay:
    """The pipeline ``Sideband`` of HF's load-balancing loss: a microbatch's per-layer counts as one message.

    ``outgoing(m)`` is ``[L, E + 2]`` float32: row ``l`` holds layer ``l``'s counts summed over the ranks that
    share the microbatch, its token count, and 1 where this rank knows them (0: not yet). ``incoming(m, t)``
    adds the rows it lacks to microbatch ``m``'s ``MoEStep.cache`` (``step_of(m)`` makes it if its forward has
    not run yet), as ``[1, E + 1]``. Counts are exact in float32 up to 2^24 assignments a layer.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __init__(self, layers: int, experts: int, step_of, device):
        self.layers, self.experts, self.step_of, self.device = layers, experts, step_of, device
        self.shape, self.dtype = (layers, experts + 2), torch.float32

    @classmethod
    def of(cls, model: nn.Module, step_of, device) -> CountsRelay | None:
        """The relay of ``model``'s counted routers (``router_loss``), or None where it has none."""
        found = [m for m in model.modules() if isinstance(m, RouterLoss)]
        return cls(found[0].layers, found[0].n, step_of, device) if found else None

    def outgoing(self, microbatch: int) -> torch.Tensor:
        t = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        for layer, stats in self.step_of(microbatch).cache.items():
            t[layer, :-1] = stats.sum(0)
            t[layer, -1] = 1
        return t

    def incoming(self, microbatch: int, t: torch.Tensor) -> None:
        cache = self.step_of(microbatch).cache
        for layer in torch.nonzero(t[:, -1]).flatten().tolist():  # one host read of the known rows
            cache.setdefault(layer, t[layer, :-1][None])
