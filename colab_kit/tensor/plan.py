"""``TensorPlan``: the contract every tensor-parallel mode keeps (see ``colab_kit.tensor``), and the helpers
the modes share: summing ``Partial`` gradients over their axes, regrouping a fused q/k/v weight, checking
that sizes divide."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .. import comm
from ..config import Axis, ConfigError
from ..policy import expand, get_module, policy_for, set_module
from .cross_entropy import vocab_parallel_cross_entropy
from ..placement import PlacementTable, add_partial, mark_parts
from ..sharded_init import cut

__all__ = ["TensorPlan", "sync_grads", "regrouped", "require_divisible"]


def sync_grads(module, mesh, table=None, skip=()) -> None:
    """Sum every gradient that is ``Partial()`` on an axis over that axis (``colab_kit.placement``).

    ``table``: the engine's ``PlacementTable`` (its parameters are what is summed: the model's, or
    their fp32 masters); None reads the declarations of ``module``'s layers. One flat all-reduce per
    axis: the partial gradients are packed, summed, unpacked; one partial over two axes is summed
    over the first, then the second. ``skip``: axes summed already (sp, by data parallelism's reduction
    over ``dp_sp``: ``zero.folded_axes``).
    """
    table = table if table is not None else PlacementTable(module)
    by_axis: dict[str, list[torch.Tensor]] = {}
    for p in table.params:
        for axis in table.partial(p):
            if p.grad is not None and mesh.size(axis) > 1 and axis not in skip:
                by_axis.setdefault(axis, []).append(p.grad)
    for axis, grads in by_axis.items():
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, mesh, axis, tag="replicated grads")
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


class TensorPlan:
    """Base of the per-mode plans; see the module docstring for the contract."""

    mode = ""
    batch_axes: tuple[str, ...] = ()

    def __init__(self, mesh):
        self.mesh = mesh

    @property
    def batch_shards(self) -> int:
        return math.prod(self.mesh.size(a) for a in self.batch_axes)

    def shard_batch(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows: split over ``batch_axes``, slowest axis first."""
        for axis in self.batch_axes:
            n, i = self.mesh.size(axis), self.mesh.rank(axis)
            if rows.shape[0] % n:
                raise ValueError(f"{rows.shape[0]} rows do not split over {axis}={n} inside tp_mode="
                                 f"{self.mode!r}: use a batch whose rows per dp rank are a multiple of "
                                 f"{self.batch_shards}")
            rows = rows.chunk(n)[i]
        return rows

    @classmethod
    def check(cls, model_cfg, layout) -> None:
        """Raise ConfigError when the model's sizes do not divide over this mode's mesh.

        Pure: ``layout`` is a ``MeshLayout``, so the check runs in the notebook kernel
        before any process is touched (``check_model``).
        """

    @classmethod
    def refused_layers(cls, model_cfg) -> str | None:
        """Why this mode has no form for some of the model's layers (``model_sizes``' roles and tied pairs), or
        None: every mode but split_gather takes what a policy names."""
        return None

    # ------------------------------------------------------------------ lowering a policy
    head_axes: tuple[str, ...] = (Axis.TP,)
    """Axes over which the attention heads are split (their sizes divide each head count)."""
    vocab_axis: str = Axis.TP
    """The axis the logits' vocabulary (or classes) is split over, for the vocab-parallel loss."""
    hidden_axes: tuple[str, ...] = ()
    """Axes over which the residual stream's features (its last dim) are split, slowest first."""
    token_axes: tuple[str, ...] = ()
    """Axes over which the residual stream's tokens (dim 1) are split (split_gather's tp)."""

    def dropout_rows(self, dp_rows: torch.Tensor, microbatches: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global row ids of microbatch ``i``'s residual stream and of its attention inputs on this rank,
        given this dp rank's ``dp_rows`` (``colab_kit.models.dropout``): the engine splits the batch over
        ``batch_axes`` and then into microbatches, and both tensors have the token rows."""
        rows = self.shard_batch(dp_rows).chunk(microbatches)[i]
        return rows, rows

    def layer(self, role: str, path: str, dense: nn.Module) -> nn.Module | None:
        """This mode's layer for a dense module of ``role`` (None: keep it whole on every rank)."""
        raise NotImplementedError

    def parallelize(self, model: nn.Module, policy=None) -> nn.Module:
        """Replace every layer ``policy`` names by this mode's (in the model's own module order, so a
        meta model's shards are made one at a time), divide the attention head counts by the head split,
        and tie what the policy ties. The model's own forward code then runs on the local shards."""
        if policy is None:
            policy = policy_for(model)
        policy.check(model)
        split = math.prod(self.mesh.size(a) for a in self.head_axes)
        fused = {p: k for pattern, k in policy.fused.items()
                 for p in expand(pattern, policy.blocks, len(policy.block_list(model)))}
        dense_of = {}
        for path, role, dense in policy.modules(model):
            dense_of[path] = dense
            if path in fused:  # [q | k | v] -> [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: a contiguous split is whole parts
                dense = regrouped(dense, fused[path], split)
            new = self.layer(role, path, dense)
            if new is not None:
                if path in fused:
                    mark_parts(new, fused[path])
                set_module(model, path, new)
        for path, att, what in policy.attentions(model):
            for name in (*what.heads, *what.kv_heads, *what.widths):
                setattr(att, name, getattr(att, name) // split)
            self._per_head_params(path, att, dense_of)
        for a, b in policy.tied:  # the head as it was (dense), the table as this mode made it
            self.tie(model, get_module(model, a), dense_of.get(b, get_module(model, b)), a, b)
        return model

    def _per_head_params(self, path: str, att: nn.Module, named: dict) -> None:
        """Per-head parameters of an attention module that no policy role names (Qwen3's ``q_norm`` and ``k_norm``:
        one vector of the module's ``head_dim`` applied to every head) stay whole on each rank, which applies them
        to its own heads of its own rows only: their gradient is ``Partial`` over the head and batch axes, summed
        after backward (``sync_grads``). Worked example, tp=2 (1d), 4 heads: rank 0's ``q_norm.weight.grad`` holds
        heads 0-1's part, rank 1's heads 2-3's; both hold the sum after the step's all-reduce. A parameter of
        another size (a norm over the whole width, before the split or after the output's sum) keeps what it
        had: it sees every feature on every rank."""
        head_dim = getattr(att, "head_dim", None)
        if not isinstance(head_dim, int) or isinstance(head_dim, bool):
            return
        axes = (*self.head_axes, *self.batch_axes)
        for sub, mod in att.named_modules(prefix=path):
            if any(sub == n or sub.startswith(n + ".") for n in named):
                continue  # a layer the policy names: the mode's layer declared its own parameters
            for name, p in mod.named_parameters(recurse=False):
                if p.dim() == 1 and p.shape[0] == head_dim:
                    for axis in axes:
                        add_partial(mod, name, axis)

    def tie(self, model: nn.Module, table: nn.Module, head: nn.Module, table_path: str, head_path: str) -> None:
        """Make the head at ``head_path`` use ``table``'s (sharded) weight again (the policy's ``tied``);
        ``head`` is the dense head module, before this mode replaced it."""
        raise ConfigError(f"tp_mode={self.mesh.config.tp_mode!r} cannot shard {head_path} tied to {table_path} "
                          f"yet: untie them (e.g. BERTConfig(tie_embeddings=False)) or use tp_mode '1d' or '2d'")

    def token_losses(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy from logits split over ``vocab_axis`` (targets -100: any value)."""
        start = self.mesh.rank(self.vocab_axis) * logits.shape[-1]
        return vocab_parallel_cross_entropy(logits, targets, self.mesh, self.vocab_axis, start)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over this rank's tokens."""
        return self.token_losses(logits, targets).mean()


def regrouped(dense: nn.Linear, parts: int, n: int) -> nn.Linear:
    """``dense`` with its output features reordered from ``parts`` blocks (``[q | k | v]``) to ``n`` groups
    of every block's share (``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``), so that block ``i`` of a contiguous
    ``n``-way split of the output features is rank ``i``'s share of each part. A new Linear on the CPU
    (from the dense value: ``colab_kit.sharded_init``); the layer cut from it keeps only its slice.

    >>> lin = nn.Linear(1, 6, bias=False)
    >>> with torch.no_grad(): _ = lin.weight.copy_(torch.arange(6.).view(6, 1))   # q0 q1 | k0 k1 | v0 v1
    >>> regrouped(lin, 3, 2).weight.flatten().tolist()
    [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]
    """
    out = dense.out_features
    if out % (parts * n):
        raise ConfigError(f"{out} fused output features in {parts} parts do not split over {n} ranks: "
                          f"each part's size must be a multiple of {n}")
    order = torch.arange(out).view(parts, n, out // (parts * n)).transpose(0, 1).reshape(-1)
    new = nn.Linear(dense.in_features, out, bias=dense.bias is not None, device="meta")
    new.weight = nn.Parameter(cut(dense.weight, lambda d: d[order]))
    if dense.bias is not None:
        new.bias = nn.Parameter(cut(dense.bias, lambda d: d[order]))
    return new


def require_divisible(what: dict[str, int], by: int, rule: str) -> None:
    """ConfigError naming every size in ``what`` that ``by`` does not divide."""
    bad = {k: v for k, v in what.items() if v % by}
    if bad:
        sizes = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ConfigError(f"{sizes} not divisible by {by}: {rule}")
