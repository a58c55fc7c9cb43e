"""``SequencePlan``: how ``sp_mode`` "ring" or "ulysses" splits a GPT's sequence over the ``sp`` axis.

Every rank of an ``sp`` group holds the whole model and ``t / sp`` of each sequence's tokens
(ring: the zigzag layout, so the causal work is even; ulysses: contiguous, its all-to-all gives
every rank whole heads over the whole sequence). Only attention mixes tokens, so only
attention talks: the plan replaces each block's ``attn.attend`` with ``ring_attention`` or
``ulysses_attention`` on this mesh, and the position table with one that looks up the global
positions of this rank's tokens. Everything else (embeddings, LayerNorm, MLP, head, loss) runs
on the local tokens unchanged.

The loss and the gradients. Each rank's loss is the mean over its own tokens; as every rank of
an sp group holds the same number of tokens, the global mean is the mean over sp of the local
means (the engine all-reduces it over sp as over dp). The parameters are replicated over sp,
so their gradients are summed over sp after backward (``Partial()`` over sp in the placement table), with
the backward started from ``loss / sp``, as ``dp`` divides by dp. The sum is data parallelism's own
reduction, which runs over the dp x sp ranks (``zero.reduction_axis``): one all-reduce (ZeRO: one
reduce-scatter, a ``1 / (dp sp)`` shard) sums over sp and averages over dp.

Worked example, ``sp=2`` ring, a batch of 2 sequences of 8 tokens::

    rank 0   tokens [0 1 6 7] of each row, positions [0 1 6 7]; loss_0 = mean over its 16 tokens
    rank 1   tokens [2 3 4 5] of each row, positions [2 3 4 5]; loss_1 likewise
    attention: K/V chunks go round the ring (1 rotation), online softmax merges the blocks
    global loss = (loss_0 + loss_1) / 2 (all-reduce over sp), equal to the unsplit loss
    backward from loss_r / 2; gradients all-reduced over dp x sp, / dp -> one process's gradient

A sequence whose length does not split into ``2 sp`` chunks (ring) or ``sp`` pieces (ulysses,
with its head count divisible by sp) is refused at the first step, before any collective, with
the multiple to use (``check_length``, ``check_heads``).
"""
from __future__ import annotations

import functools
import weakref
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.dropout import attention_dropout, attention_keep, attention_number, current
from ..policy.classes import derived_class, derived_from
from ..config import Axis, ConfigError
from .ring import RingRecorder, gather_keys, ring_attention
from .ulysses import check_heads, ulysses_attention
from .zigzag import check_length, sequence_positions, split_sequence
from ..placement import add_partial
from ..policy import policy_for

__all__ = ["SequencePlan", "SequencePositions", "LAYOUT", "attention_refusal", "scale_refusal"]

LAYOUT = {"ring": "zigzag", "ulysses": "contiguous"}
"""The token layout over sp of each mode."""


def attention_refusal(policy_name: str | None, attends: bool, sequence: bool, bidirectional_hf: bool) -> str | None:
    """Why sequence parallelism cannot take a model's attention, or None: ``attends``, every attention names its
    ``attend`` method or is transformers' (the plan replaces it); ``sequence``, the inputs have a token dim;
    ``bidirectional_hf``, a transformers attention that is not causal (the plan runs those causally)."""
    if not attends:
        return (f"sequence parallelism replaces each attention's attend(q, k, v); policy {policy_name!r} names none "
                f"for some attention module: give Attention(attend='<method name>') in the policy, or use sp=1")
    if not sequence:
        return (f"sequence parallelism splits the inputs' tokens (dim 1); policy {policy_name!r} says its inputs have "
                f"no token dimension (ViT's are images, its tokens made inside the model): use sp=1 for this model, "
                f"and tp or pp to split it")
    if bidirectional_hf:
        return (f"sequence parallelism runs transformers' attention functions causally; policy {policy_name!r} has "
                f"a bidirectional one: use sp=1 for this model")
    return None


def scale_refusal(scaling: float | None, head_dim: int) -> str | None:
    """Why sequence parallelism cannot run a transformers attention that scales ``q . k`` by ``scaling`` with
    query heads ``head_dim`` wide, or None: ring and Ulysses scale by ``1 / sqrt(head_dim)`` (DeepSeek-V3's
    published YaRN rope scales by ``mscale**2`` more)."""
    if scaling is None or abs(scaling - head_dim ** -0.5) <= 1e-12:
        return None
    return (f"sequence parallelism scales attention by 1/sqrt(head_dim); this model asks for {scaling}: use sp=1 "
            f"for it")


class SequencePositions(nn.Embedding):
    """A position table that looks up the global positions of this rank's tokens.

    ``forward(torch.arange(t_local))`` (what ``GPT.embed`` passes) returns the rows of the
    positions this rank holds: with sp=2 ring, rank 1's ``arange(4)`` reads rows [2 3 4 5] of 8.
    Same parameter as the ``nn.Embedding`` it was (only the class changes).
    """

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(_global_positions(self, positions), self.weight)


_PLACED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per position table or rotary module this plan changed: ``(sp rank, sp size, layout)`` (kept here, not on it)."""


def _global_positions(module: nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """The global positions of this rank's tokens ``positions`` (local ``0 .. t_local - 1``) for ``module``."""
    rank, size, layout = _PLACED.get(module, (0, 1, "zigzag"))
    glob = sequence_positions(rank, size, positions.shape[-1] * size, layout, device=positions.device)
    return glob[positions]


def _global_positions_class(cls: type) -> type:
    """The subclass of a rotary-embedding module ``cls`` (called as ``(x, position_ids)``) that looks up
    the global positions of this rank's tokens: with sp=2 ring, rank 1's ``arange(4)`` becomes [2 3 4 5]."""
    if derived_from(cls, "GlobalPositions") is not None:
        return cls

    def make_forward(cls):
        def forward(self, x, position_ids, *args, **kwargs):
            return cls.forward(self, x, _global_positions(self, position_ids), *args, **kwargs)
        return forward

    return derived_class(cls, "GlobalPositions", make_forward, __name__,
                         f"``{cls.__name__}`` at this rank's global positions (colab_kit.sequence.plan).")


def _ring_dropout(module, p, shape, n):
    """The ring's ``drop(q_chunk, k_chunk)``: the block of the whole-sequence dropout mask at those chunks'
    global positions (chunk ``u`` holds positions ``u c .. u c + c - 1``), drawn with the coordinates of the
    microbatch running now (kept for backward)."""
    coords, (layer, seed) = current(), attention_number(module)
    if coords is None:
        raise RuntimeError("ring attention dropout runs inside the engine's step (its coordinates are not set)")
    b, h, t_local, _ = shape
    c, dev = t_local // 2, coords.token_rows.device
    scale = 1.0 / (1.0 - p)

    def drop(q_chunk: int, k_chunk: int):
        pos = torch.arange(c)
        keep = attention_keep(coords, coords.step, p, layer, seed, b, h, q_chunk * c + pos, k_chunk * c + pos,
                              2 * n * c, dev)
        return keep, scale
    return drop


def _eager_dropout(q, k, v, keys, *, module, p, scale):
    """Causal eager attention of whole sequences with layout-invariant dropout of the probabilities (a Hugging
    Face attention under Ulysses): the coordinates' heads are this rank's after the all-to-all."""
    t = q.shape[2]
    scores = (q @ k.transpose(-1, -2)) * scale
    allowed = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    if keys is not None:
        allowed = allowed & keys[:, None, None, :]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")).float(), dim=-1).to(q.dtype)
    probs = attention_dropout(probs, p, *attention_number(module), calls_from=module)
    return probs @ v


class SequencePlan:
    """Split the sequence over ``sp`` for ``mesh.config.sp_mode`` ("ring" or "ulysses")."""

    def __init__(self, mesh, axis: str = Axis.SP):
        self.mesh, self.axis = mesh, axis
        self.mode = mesh.config.sp_mode
        if self.mode not in LAYOUT:
            raise ConfigError(f"SequencePlan runs sp_mode 'ring' or 'ulysses', got {self.mode!r}")
        self.size, self.rank = mesh.size(axis), mesh.rank(axis)
        self.layout = LAYOUT[self.mode]
        self.recorder = RingRecorder() if self.mode == "ring" else None
        """Ring: the rotations of the last forward and backward (which K/V chunk each rank held)."""
        self.undo: list = []
        """What ``parallelize`` changed on the user's modules, as calls that put each back (``restore``)."""
        self._hf_name: str | None = None

    @staticmethod
    def check(model_cfg, config) -> None:
        """Refuse what cannot split, in the kernel: Ulysses needs the heads per tensor rank to divide by sp.
        ``model_cfg``: a config with ``n_heads``, or the namespace ``tensor.model_sizes`` reads off a model."""
        if config.sp > 1 and config.sp_mode == "ulysses":
            check_heads(model_cfg.n_heads // config.tp, config.sp)

    @staticmethod
    def check_policy(model, policy, config) -> None:
        """What the policy must say for sequence parallelism: an ``attend`` on every attention, all causal
        (``attention_refusal``, the sequence part's rule applies before any process)."""
        atts = policy.attentions(model)
        why = attention_refusal(policy.name, bool(atts) and all(a.attend is not None or a.hf for _, _, a in atts),
                                policy.sequence, any(a.hf and not a.causal for _, _, a in atts))
        if why is not None:
            raise ConfigError(why)

    def check_length(self, t: int) -> None:
        """A sequence of ``t`` tokens must split into this mode's pieces (before any collective)."""
        check_length(t, self.size, self.layout)

    # ------------------------------------------------------------------ the model
    def parallelize(self, model: nn.Module, policy=None) -> nn.Module:
        """Attention through the ring (or all-to-all), positions looked up globally, gradients summed over sp.

        What changes comes from the policy: each attention module's ``attend`` method (an instance
        attribute: the model's code is not touched) and each ``positions`` table."""
        policy = policy or policy_for(model)
        policy.check(model, kinds=False)  # after the tensor plan
        self.check_policy(model, policy, self.mesh.config)
        for _, module, a in policy.attentions(model):
            if a.hf:  # transformers' registry: this plan's function, under a name of its own
                cfg, before = module.config, module.config._attn_implementation
                cfg._attn_implementation = self.hf_attention()
                self.undo.append(functools.partial(setattr, cfg, "_attn_implementation", before))
            else:  # an instance attribute: the model's code is not touched
                setattr(module, a.attend, functools.partial(self.attend, causal=a.causal))
                self.undo.append(functools.partial(delattr, module, a.attend))
        for _, _, rot in policy.modules(model, "rotary"):
            self.undo.append(functools.partial(setattr, rot, "__class__", type(rot)))
            rot.__class__ = _global_positions_class(type(rot))
            _PLACED[rot] = (self.rank, self.size, self.layout)
        for path, _, pos in policy.modules(model, "positions"):
            if type(pos) is not nn.Embedding:
                raise ConfigError(f"sequence parallelism expects the position table {path} to be an nn.Embedding, "
                                  f"got {type(pos).__name__} (tp_mode={self.mesh.config.tp_mode!r}): use tp_mode='1d'")
            self.undo.append(functools.partial(setattr, pos, "__class__", nn.Embedding))
            pos.__class__ = SequencePositions
            _PLACED[pos] = (self.rank, self.size, self.layout)
        for module in model.modules():  # replicated over sp, each rank's tokens: Partial() over it after backward
            for name, _ in module.named_parameters(recurse=False):
                add_partial(module, name, self.axis)
        return model

    def restore(self) -> None:
        """Put back what ``parallelize`` changed on the user's modules (``engine.close()`` calls it): each
        attention's own ``attend`` and attention implementation, the position tables' and rotary modules'
        classes; this plan's function leaves transformers' registry. The parameters were never split over
        sp, so a model trained under ring or Ulysses (without tp, pp or ZeRO-3) is after ``close()`` the dense
        model it was, trained: its forward in one process gives one process's logits. Idempotent."""
        while self.undo:
            self.undo.pop()()
        if self._hf_name is not None:
            from transformers import AttentionInterface, AttentionMaskInterface
            for registry in (AttentionInterface, AttentionMaskInterface):
                registry._global_mapping.pop(self._hf_name, None)
            self._hf_name = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, *,
               causal: bool = True, local=None, drop=None) -> torch.Tensor:
        """Attention of this rank's tokens over the whole sequence: causal or not, keys masked where this
        rank's ``mask [b, t_local]`` (BERT's padding) is False."""
        keys = None
        if mask is not None and self.size > 1:  # every layer gets the same mask: gathered once per forward
            if mask is not self._mask:
                self._mask, self._keys = mask, gather_keys(mask, self.mesh, self.axis)
            keys = self._keys
        if self.mode == "ring":
            return ring_attention(q, k, v, self.mesh, self.axis, layout=self.layout, recorder=self.recorder,
                                  causal=causal, mask=mask, keys=keys, drop=drop)
        return ulysses_attention(q, k, v, self.mesh, self.axis, layout=self.layout, causal=causal, mask=mask,
                                 keys=keys, local=local, wrap=self._core)

    _core = None  # what Ulysses runs its local attention in (``recompute_core``)

    def recompute_core(self, wrap) -> int:
        """Selective recomputation (``colab_kit.recompute.selective``): Ulysses runs its local attention, between
        the all-to-alls, in ``wrap`` (a checkpoint), so backward recomputes it and no all-to-all is repeated.
        The ring changes nothing: its backward already rebuilds every score block from q, k, v, the output
        and the log-sum-exp, and a checkpoint around it would repeat its K/V rotations. Returns the number
        of cores that now recompute (0 for the ring)."""
        if self.mode != "ulysses":
            return 0
        self._core = wrap
        return 1

    _mask: torch.Tensor | None = None  # the last key-padding mask seen, and every rank's copy of it (``gather_keys``)
    _keys: torch.Tensor | None = None

    def hf_attention(self) -> str:
        """Register this plan's attention in ``transformers``' registry (once) and return its name: the
        function a Hugging Face attention module calls, ``(module, q, k, v, mask, dropout, scaling)``,
        with grouped key/value heads repeated, run through the ring or the all-to-all."""
        name = f"colab_kit_sp_{id(self)}"
        if self._hf_name == name:
            return name
        from transformers import AttentionInterface, AttentionMaskInterface

        def attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
            d = query.shape[-1]
            why = scale_refusal(scaling, d)  # refused before any process too (the parts' rules, engine.parts)
            if why is not None:
                raise ConfigError(why)
            local = drop = None
            if dropout and module.training and self.mode == "ulysses":  # whole rows of this rank's heads
                local = functools.partial(_eager_dropout, module=module, p=dropout, scale=d ** -0.5)
            elif dropout and module.training:  # the ring: each block draws its part of the whole mask
                drop = _ring_dropout(module, dropout, query.shape, self.size)
            groups = query.shape[1] // key.shape[1]
            if groups > 1:
                key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
            return self.attend(query, key, value, local=local, drop=drop).transpose(1, 2).contiguous(), None

        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, lambda *args, **kwargs: None)  # the ring masks by global position
        self._hf_name = name
        return name

    def begin_step(self) -> None:
        """A new step: the ring's records start afresh (they hold the last step's rotations only)."""
        if self.recorder is not None:
            self.recorder.events.clear()
            self.recorder.t0 = time.perf_counter()

    # ------------------------------------------------------------------ the batch
    def shard_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of every row (``[b, t] -> [b, t / sp]``, in this mode's layout)."""
        self.check_length(rows.shape[1])
        return split_sequence(rows, self.rank, self.size, dim=1, layout=self.layout)
