"""Cut a GPT into pipeline stages: each stage a module holding only its own parameters.

The ``n_layers`` blocks are dealt evenly over ``S = pp * chunks`` stages, in order;
the embeddings go with the first stage, the final LayerNorm and the LM head (and so
the loss) with the last. Stage ``s`` is chunk ``s // pp`` of the pipeline rank
``PipelinePlan.rank_of(s)`` names (the schedule's placement). Worked example, ``n_layers=4``, ``pp=2``::

    chunks=1 (gpipe, 1f1b, zb-h1)   rank 0: stage 0 = tok, pos, blocks 0-1
                                    rank 1: stage 1 = blocks 2-3, ln_f, head
    chunks=2, 'loop' (interleaved)  rank 0: stage 0 = tok, pos, block 0 | stage 2 = block 2
                                    rank 1: stage 1 = block 1 | stage 3 = block 3, ln_f, head
    chunks=2, 'v' (zb-v)            rank 0: stage 0 = tok, pos, block 0 | stage 3 = block 3, ln_f, head
                                    rank 1: stage 1 = block 1 | stage 2 = block 2

Under the V, rank 0 holds both the embeddings and the head (so the loss), and rank 1 passes
block 1's output to block 2 in its own memory.

The split works on the model *after* the tensor plan has sharded it, so a stage's
modules are the tensor-parallel layers of this rank. What a stage runs comes from the model's
policy (``colab_kit.policy``): the first stage runs ``policy.embed(model, inputs)``, every stage
its blocks, the last ``policy.finish(model, hidden)``. Each stage holds a *shell* of the model: the
same classes and attribute names, with the blocks list cut down to its own blocks and every module
of another stage replaced by a parameterless ``Elsewhere`` placeholder, so the model's own code runs
unchanged on the parts it holds (a user's model, a Hugging Face one, the built-in GPT alike).
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from ..config import ConfigError
from ..sharded_init import defer
from ..policy import get_module, missing_policy_message, policy_for
from .plan import PipelinePlan, SCHEDULE_PLACEMENT

__all__ = ["Stage", "stage_layers", "split_model", "check_stages", "tied_across_ranks", "Elsewhere", "defer_stages"]



def check_stages(n_layers: int, config) -> None:
    """ConfigError unless ``n_layers`` blocks split evenly over ``pp * chunks`` stages (pure)."""
    n = config.pp * config.chunks
    if n_layers % n:
        ok = [k for k in range(1, n_layers + 1) if n_layers % k == 0]
        raise ConfigError(f"n_layers={n_layers} does not split evenly over pp*chunks = {config.pp}*{config.chunks} = "
                          f"{n} pipeline stages: use n_layers a multiple of {n} (e.g. {n * max(1, n_layers // n)}), "
                          f"or pp*chunks one of {', '.join(map(str, ok))}")


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """Block indices of each stage: ``stage_layers(4, 2) == [range(0, 2), range(2, 4)]``."""
    per = n_layers // n_stages
    return [range(s * per, (s + 1) * per) for s in range(n_stages)]


class Elsewhere(nn.Module):
    """Stands in a stage's shell for a module that another pipeline stage holds."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.path} lives on another pipeline stage: the policy's embed/finish used a "
                           f"module its stage does not hold (list it in Policy.tail if finish needs it)")

    def extra_repr(self) -> str:
        return self.path


def _shell(module: nn.Module, path: str, keep, blocks_path: str, blocks: nn.ModuleList, first: bool) -> nn.Module:
    """A copy of ``module`` (the same class and attributes) whose children are kept, cut down or replaced."""
    shell = copy.copy(module)
    shell._modules = {}
    shell._parameters = dict(module._parameters) if first else {}  # direct parameters go with the embeddings
    shell._buffers = dict(module._buffers) if first else {}
    for name, child in module._modules.items():
        sub = f"{path}.{name}" if path else name
        if sub == blocks_path:
            shell._modules[name] = blocks
        elif keep(sub) == "all":
            shell._modules[name] = child
        elif keep(sub) == "part":
            assert child is not None  # a part of the model kept in part is a module
            shell._modules[name] = _shell(child, sub, keep, blocks_path, blocks, first)
        else:
            shell._modules[name] = Elsewhere(sub) if child is not None else None
    return shell


class Stage(nn.Module):
    """Stage ``index`` of ``n_stages``: ``forward(x, inputs)`` maps its input to its output.

    The first stage takes the batch's inputs (token ids ``[b, t]``, images); the last returns logits.
    ``inputs`` (the microbatch's inputs, which every stage has) feeds ``policy.context``, e.g. BERT's
    padding mask, passed to every block. ``source_names`` gives, for each of this stage's parameters in
    order, its name in the whole model (``blocks.2.attn.qkv.weight``), so it can be compared with an
    unsplit model.
    """

    def __init__(self, model: nn.Module, policy, index: int, n_stages: int, layers: range, names: dict[int, str]):
        super().__init__()
        self.index, self.n_stages, self.policy = index, n_stages, policy
        self.first, self.last = index == 0, index == n_stages - 1
        all_blocks = policy.block_list(model)
        blocks = nn.ModuleList(all_blocks[i] for i in layers)
        tail = tuple(policy.tail)

        def keep(path: str) -> str:
            on_way = any(t.startswith(path + ".") for t in (policy.blocks, *tail, *policy.everywhere))
            if path in policy.everywhere:
                return "all"
            if path in tail:
                return "all" if self.last else "none"
            if on_way:
                return "part"
            return "all" if self.first else "none"

        self.model = _shell(model, "", keep, policy.blocks, blocks, self.first)
        self.layers = layers
        self.source_names = [names[id(p)] for p in self.parameters()]

    @property
    def blocks(self) -> nn.ModuleList:
        """This stage's blocks (inside its shell of the model)."""
        blocks = get_module(self.model, self.policy.blocks)
        assert isinstance(blocks, nn.ModuleList)  # the policy's blocks path names one (Policy.block_list)
        return blocks

    def forward(self, x: torch.Tensor, inputs: torch.Tensor | None = None) -> torch.Tensor:
        if self.first:
            x = self.policy.embed(self.model, x if inputs is None else inputs)
        ctx = self.policy.context(self.model, inputs) if self.policy.context is not None and inputs is not None else {}
        for block in self.blocks:
            x = block(x, **ctx)
        if self.last:
            x = self.policy.finish(self.model, x)
        return x

    def extra_repr(self) -> str:
        what = (["embeddings"] if self.first else []) + [f"blocks {self.layers.start}-{self.layers.stop - 1}"] + (
            [", ".join(self.policy.tail) or "finish"] if self.last else [])
        return f"stage {self.index} of {self.n_stages}: " + ", ".join(what)


def tied_across_ranks(model: nn.Module, config, policy) -> list[torch.Tensor]:
    """The weights of ``policy.tied`` (before the split, after the tensor plan: this rank's shard shape,
    meta where another rank builds it) whose first and last stage live on different pipeline ranks."""
    n = config.pp * config.chunks
    where = PipelinePlan(config.pp, config.microbatches, config.chunks, config.schedule,
                 placement=SCHEDULE_PLACEMENT[config.schedule])
    if not policy.tied or where.rank_of(0) == where.rank_of(n - 1):
        return []
    weights = []
    for a, _ in policy.tied:
        w = get_module(model, a).weight
        assert isinstance(w, torch.Tensor)  # a tied pair's weights are parameters
        weights.append(w)
    return weights


def split_model(model: nn.Module, config, pp_rank: int, policy=None) -> list[Stage]:
    """The stages of pipeline rank ``pp_rank``, in chunk order: ``PipelinePlan.stages_of`` under the schedule's
    placement (``[pp_rank, pp_rank + pp]`` for interleaved, ``[pp_rank, 2*pp - 1 - pp_rank]`` for zb-v)."""
    policy = policy_for(model, policy)
    if policy is None:
        raise ConfigError(missing_policy_message(model, f"pipeline parallelism (pp={config.pp})"))
    policy.check(model, kinds=False)  # after the tensor plan
    n_layers = len(policy.block_list(model))
    check_stages(n_layers, config)

    n = config.pp * config.chunks
    names = {id(p): name for name, p in model.named_parameters()}
    layers = stage_layers(n_layers, n)
    where = PipelinePlan(config.pp, config.microbatches, config.chunks, config.schedule,
                 placement=SCHEDULE_PLACEMENT[config.schedule])
    return [Stage(model, policy, s, n, layers[s], names) for s in where.stages_of(pp_rank)]


def defer_stages(model: nn.Module, config=None, pp_rank: int = 0, policy=None) -> bool:
    """``colab_kit.sharded_init.defer`` for pipeline rank ``pp_rank``: with ``config.pp > 1`` only the meta
    tensors of its stages get a recipe (the same split the engine makes after the tensor plan), so no rank
    makes a shard of another rank's stage; else every one does. Whether the model had meta tensors."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return False  # a dense model: nothing to defer, no split to make
    keep = split_model(model, config, pp_rank, policy) if config is not None and config.pp > 1 else None
    return defer(model, keep)
