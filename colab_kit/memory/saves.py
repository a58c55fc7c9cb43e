"""What one decoder block saves for backward, by architecture: the per-op count behind ``activation_bytes``,
for the built-in GPT and for the Hugging Face decoders the engine runs as they are (Llama, Mistral, Qwen2,
Qwen3: an RMSNorm that computes in fp32, a SwiGLU MLP, grouped-query attention, per-head q/k norms).

Read off autograd's saved tensors of the modules themselves (each storage once, parameters never; what
``ActivationMeter`` counts), N tokens on a rank, e bytes an element of the compute dtype, tp 1D ranks, a
sequence split s (split_gather), h the residual width, q the query width (heads x head dim), kv the key/value
width, a and a_kv the heads, f the MLP's inner width::

    tensor                          GPT (LayerNorm, GELU)        HF Llama family (RMSNorm, SwiGLU)
    each of the two norms           e N h + 2 e N        (/ s)   4 N h + e N h + 4 N   (/ s)
                                    input; mean, 1/std           fp32 copy of the input, normed, 1/rms (fp32)
    the norms' outputs (matmul in)  2 e N h                      2 e N h
    attention kernel                e N (2 q + 2 kv) + 4 N a     (/ tp) q, k, v, output; log-sum-exp
    q / k norms (Qwen3), / tp       -                            4 N (q + kv) + e N (q + kv) + 4 N (a + a_kv)
    MLP inner tensors               2 e N f (fc1, gelu)  (/ tp)  4 e N f (gate, silu, up, product)  (/ tp)

The engine takes every loss on fp32 logits (``precision.loss_in_fp32``): the log-softmax is 4 N V / tp bytes
whatever the compute dtype. In fp32 the norm's "fp32 copy" is its input itself: RMSNorm keeps its input, its
normed input and 1/rms (2 e N h + 4 N), LayerNorm its input, mean and 1/std (e N h + 8 N; in 16 bits the
statistics are 16-bit too, as the CPU kernel keeps them; CUDA's keeps them in fp32, 4 N more a norm).

Per-op recomputation (``recompute="op"``) keeps a block's input, the outputs of the 1st, 3rd, ... matmul in
forward order (``linears``: a GPT's fused qkv and fc1; a Llama's q, v, gate and down; a row-parallel
matmul's output is whole on every rank) and the attention kernel's output and log-sum-exp (eager attention, GPT-OSS's
with sinks, has no kernel op to keep: nothing of its core).

Worked example, a Llama block of h 64, q 64, kv 32, 4 heads, f 176 on one rank in bf16 (e 2), per token:
2 x (4 x 64 + 2 x 64 + 4) + 2 x 2 x 64 + 2 x (128 + 64) + 16 + 4 x 2 x 176 = 2,840 bytes, what the engine's
meter measures (tests/unit/test_block_saves.py); the GPT twin the planner used before (d_ff 1.5 f) counted 2,112.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..tensor import model_sizes
from .fake import per_token

__all__ = ["BlockSaves", "read_block", "mlp_columns", "qk_norm", "rms_kind", "act_saves", "mlp_module"]


@dataclass(frozen=True)
class BlockSaves:
    """One block's widths as its saved tensors see them (the table above)."""

    hidden: int
    heads: int
    ffn: int
    vocab: int
    q_width: int = 0
    """Heads x head dim (0: ``hidden``)."""
    kv_width: int = 0
    """Key/value heads x head dim (0: ``q_width``)."""
    kv_heads: int = 0
    """Key/value heads (0: ``heads``)."""
    norm: str = "layer"
    """"layer": LayerNorm (the GPT's); "rms": Hugging Face's RMSNorm, which computes in fp32 and multiplies by its
    weight in the compute dtype; "rms32": one that multiplies in fp32 too (GPT-OSS: its normed input kept in fp32)."""
    gated: bool = False
    """A SwiGLU MLP (gate, up, down) rather than fc1, GELU, fc2."""
    qk_norm: str = ""
    """RMSNorms on q and k: "head" per head (Qwen3, Qwen3-MoE), "full" over the whole width (OLMoE); "": none."""
    linears: tuple = ()
    """(output width, split over tp) of each matmul in forward order; () derives it: fused qkv, proj, fc1, fc2
    (GPT), or q, k, v, o, gate, up, down (gated)."""
    rotary: bool = False
    """Rotary positions computed once a forward and kept by every block's product with them (Hugging Face's
    ``cos`` and ``sin``, one row per position): ``2 seq d_head e`` bytes a forward on a stage, unless per-op or
    full recomputation rebuilds them with the block."""
    latent: tuple = ()
    """Multi-head latent attention (DeepSeek-V3): ``(q rank, kv rank, rope dim, nope dim, v dim)`` a head; ()
    none. Its low-rank norms and projections' inputs, and a fused kernel's q and k (nope + rope wide), v (a view of
    ``kv_b_proj``'s output: its storage, nope + v wide), output (v wide) and log-sum-exp (``attention``)."""
    sinks_keys: int = 0
    """Eager attention with sinks (GPT-OSS): the keys a query's probabilities hold, the sequence and its sink;
    0: a fused kernel."""
    act_saves: int = 0
    """MLP-wide tensors the activation keeps beside its input (``read_block``: 0 for torch's GELU and SiLU; 3 for
    GPT-2's tanh GELU written out in eager ops: the tanh's output, ``0.5 x`` and ``1 + tanh``)."""

    @classmethod
    def of_gpt(cls, cfg) -> BlockSaves:
        """The built-in GPT of ``cfg`` (a ``GPTConfig``).

        >>> from colab_kit.models import GPTConfig
        >>> BlockSaves.of_gpt(GPTConfig(d_model=64, n_heads=4)).matmuls()
        ((192, True), (64, False), (256, True), (64, False))
        """
        return cls(hidden=cfg.d_model, heads=cfg.n_heads, ffn=cfg.d_ff or 4 * cfg.d_model, vocab=cfg.vocab_size)

    @classmethod
    def of_module(cls, model, policy) -> BlockSaves:
        """Read off a model with a policy (``read_block``) at its policy's widths."""
        sizes = model_sizes(model, policy)
        cols = mlp_columns(model, policy)
        read = read_block(model, policy)
        q = read.pop("q_width")
        heads = sizes.n_heads or 1
        kv_heads = sizes.kv.get("n_kv_heads", 0) or heads
        vocab = next(iter(sizes.outputs.values()), sizes.d_model)
        return cls(hidden=sizes.d_model, heads=heads, ffn=max(cols) if cols else sizes.d_ff, vocab=vocab,
                   q_width=q, kv_width=kv_heads * (q // heads), kv_heads=kv_heads, gated=len(cols) >= 2, **read)

    @property
    def inner(self) -> int:
        """MLP-wide tensors the MLP keeps: fc1's output and the activation's (GELU), or the gate's, the activation's,
        the up projection's and the product (SwiGLU), and what the activation keeps besides (``act_saves``)."""
        return (4 if self.gated else 2) + self.act_saves

    @property
    def q(self) -> int:
        return self.q_width or self.hidden

    @property
    def kv(self) -> int:
        return self.kv_width or self.q

    def matmuls(self) -> tuple:
        """``linears``, or the one its ``gated`` implies."""
        if self.linears:
            return tuple(self.linears)
        h, f = self.hidden, self.ffn
        if self.gated:
            return ((self.q, True), (self.kv, True), (self.kv, True), (h, False), (f, True), (f, True), (h, False))
        return ((self.q + 2 * self.kv, True), (h, False), (f, True), (h, False))

    # ------------------------------------------------------------------ bytes, N tokens on a rank
    def sp_copies(self, n: int, e: int, tp: int = 1, output: bool = True) -> int:
        """What ring or Ulysses sp adds to a block: k and v repeated to the q heads before the exchange
        (``SequencePlan.hf_attention``; nothing without grouped-query attention) and (``output``: unless Ulysses'
        selective recomputation drops the kernel's own) the output copied back to the model's layout, which the
        output projection saves beside the kernel's."""
        return e * n * (2 * (self.q - self.kv) + (self.q if output else 0)) // tp

    def ring_fp32(self, n: int, e: int, tp: int = 1) -> int:
        """The ring merges its blocks' outputs in fp32 (``sequence.ring``), and the copy back is that fp32 tensor:
        ``(4 - e) N q / tp`` more than ``sp_copies``' in the compute dtype."""
        return (4 - e) * n * self.q // tp

    def rope(self, seq: int, e: int) -> int:
        """The rotary tables a forward keeps (``rotary``), whatever its rows."""
        d = self.latent[2] if self.latent else self.q // self.heads
        return 2 * seq * d * e if self.rotary else 0

    def norm_bytes(self, n: int, e: int, split: int = 1) -> int:
        """One norm's own saved tensors (its output is the next matmul's input, counted there)."""
        h = self.hidden
        own = {"rms": 4 * n * h + e * n * h + 4 * n, "rms32": 8 * n * h + 4 * n}.get(self.norm, e * n * h + 2 * e * n)
        return own // split

    def attention(self, n: int, e: int) -> int:
        """What attention saves beside its input and the q/k norms, undivided by tp: a fused kernel's q, k, v,
        output (the output projection's input too) and log-sum-exp; with ``latent`` the low-rank path as well
        (each low-rank RMSNorm's fp32 copy, 1/rms and normed input, the up-projection's input; in fp32 the kv norm's
        copy is its input, a view of ``kv_a_proj``'s output, rope dims included); with ``sinks_keys`` GPT-OSS's
        eager attention: q, k and v repeated to the q heads, the probabilities over the keys and the sink (compute
        dtype), the row maxima's indices (int64), the output copied for the projection."""
        a = self.heads
        if self.latent:
            rq, rkv, dr, dn, dv = self.latent
            low = (4 * n * rq + 2 * e * n * rq + 4 * n) if rq else 0
            low += (4 * n * (rkv + dr) if e == 4 else 4 * n * rkv) + 2 * e * n * rkv + 4 * n
            return e * n * a * (2 * (dn + dr) + dn + 2 * dv) + 4 * n * a + low
        if self.sinks_keys:
            return 4 * e * n * self.q + e * n * a * self.sinks_keys + 8 * n * a
        return e * n * (2 * self.q + 2 * self.kv) + 4 * n * a

    def split_part(self, n: int, e: int) -> int:
        """What tp 1D splits, undivided: the attention kernel's tensors, the q/k norms, the MLP's inner ones."""
        return self.attention(n, e) + self.qk_bytes(n, e) + self.inner * e * n * self.ffn

    def qk_bytes(self, n: int, e: int) -> int:
        """The q and k norms' own tensors, undivided by tp: an fp32 copy, the normed, and 1/rms per head ("head",
        Qwen3) or per row ("full", OLMoE)."""
        if not self.qk_norm:
            return 0
        q, kv = self.q, self.kv
        stats = self.heads + (self.kv_heads or self.heads) if self.qk_norm == "head" else 2  # 1/rms a row
        return 4 * n * (q + kv) + e * n * (q + kv) + 4 * n * stats

    def block(self, n: int, e: int, tp: int = 1, split: int = 1) -> int:
        """Everything a block saves, no recomputation."""
        return 2 * self.norm_bytes(n, e, split) + 2 * e * n * self.hidden + self.split_part(n, e) // tp

    def core(self, n: int, tp: int = 1) -> int:
        """What attention's core alone keeps: the log-sum-exp (fp32), what selective recomputation drops."""
        return 4 * n * self.heads // tp

    def kernel(self, n: int, e: int, tp: int = 1) -> int:
        """The attention kernel's own outputs, what per-op recomputation keeps of attention's core: its output
        (``latent``: v heads wide) and log-sum-exp; 0 for eager attention (``sinks_keys``: matmuls, a softmax,
        no kernel op to keep)."""
        if self.sinks_keys:
            return 0
        width = self.heads * self.latent[4] if self.latent else self.q
        return (e * n * width + 4 * n * self.heads) // tp

    def op_kept(self, n: int, e: int, tp: int = 1, split: int = 1) -> int:
        """What per-op recomputation keeps: the input, every second matmul's output (the 1st, 3rd, ...), the
        kernel's outputs."""
        kept = self.matmuls()[::2]
        whole = sum(w for w, s in kept if not s)
        return (e * n * self.hidden) // split + e * n * whole \
            + (e * n * sum(w for w, s in kept if s)) // tp + self.kernel(n, e, tp)

    def mlp_bytes(self, n: int, e: int, tp: int = 1, mode: str = "none") -> int:
        """What the block's MLP keeps: its inner tensors ("none", "selective"), or under per-op recomputation its
        kept matmuls' outputs (the last two or three of ``matmuls()``, kept by their place in the whole block:
        a GPT's fc1, a Llama's gate and down: the MLP's matmuls must end the list, as in every block read here);
        what a mixture of experts' MoE layer replaces (``memory.experts.moe_block_extra``)."""
        if mode == "op":
            mm = self.matmuls()
            mlp = range(len(mm) - (3 if self.gated else 2), len(mm))
            kept = [mm[i] for i in mlp if i % 2 == 0]
            return e * n * sum(w for w, s in kept if not s) + e * n * sum(w for w, s in kept if s) // tp
        return self.inner * e * n * self.ffn // tp

    def head(self, n: int, e: int, tp: int = 1, split: int = 1) -> int:
        """The last stage's norm, head input, log-softmax (fp32: ``precision.loss_in_fp32``), targets and the loss's
        weight."""
        return self.norm_bytes(n, e, split) + e * n * self.hidden + 4 * n * self.vocab // tp + 8 * n + 4

    def store(self, n: int, e: int, tp: int, layers: int, last: bool) -> int:
        """What a zero-bubble I leaves for its W (``tensor.zero_bubble.WeightGradStore``): each Linear's input once
        (q, k, v share one; gate and up another): h + q / tp (the output projection) + h + f / tp (the MLP's last)
        a block, and each Linear's output gradient (``matmuls()``: a column-split one's / tp, a row-split one's
        whole); the head's input and output gradient."""
        grads = sum(w // tp if split else w for w, split in self.matmuls())
        block = e * n * (self.hidden + self.q // tp + self.hidden + self.ffn // tp + grads)
        return layers * block + (e * n * (self.hidden + self.vocab // tp) if last else 0)


def _mlp_linears(model, policy) -> list:
    """(path, module) of block 0's column-split Linears outside attention: the MLP's (two where gated)."""
    inside = {p for p, _, _ in policy.attentions(model)}
    first = policy.blocks + ".0."
    return [(p, m) for p, _, m in policy.modules(model, "column")
            if p.startswith(first) and not any(p.startswith(a + ".") for a in inside)]


def mlp_columns(model, policy) -> list[int]:
    """Output widths of block 0's column-split Linears outside attention: the MLP's (two where gated)."""
    return [m.out_features for _, m in _mlp_linears(model, policy)]


def read_block(model, policy) -> dict:
    """What ``BlockSaves`` needs beyond the widths, read off block 0 of a dense ``model`` (a meta twin will do) with
    its ``policy``: the q width (a Hugging Face config's ``head_dim`` times the heads), the norm ("rms" where every
    norm of the block is a Hugging Face RMSNorm, which upcasts to fp32; a LayerNorm's count otherwise), per-head
    q/k norms, whether rotary tables are kept (the policy's "rotary" role), the matmuls (every ``nn.Linear`` in
    module order, split where the policy makes it a column)."""
    block = policy.block_list(model)[0]
    hf = getattr(model, "config", None)
    head_dim = int(getattr(hf, "head_dim", 0) or 0) if hf is not None and hasattr(hf, "to_dict") else 0
    sizes = model_sizes(model, policy)
    columns = {id(m) for _, _, m in policy.modules(model, "column")}
    norms = [type(m) for n, m in block.named_modules() if n and "norm" in type(m).__name__.lower()]
    return {"q_width": (sizes.n_heads or 1) * head_dim if head_dim else sizes.d_model,
            "norm": "rms" if norms and all(c.__module__.startswith("transformers.") and "rms" in c.__name__.lower()
                                           for c in norms) else "layer",
            "qk_norm": qk_norm(block, head_dim or sizes.d_model // (sizes.n_heads or 1)),
            "rotary": bool(policy.modules(model, "rotary")),
            "act_saves": act_saves(mlp_module(model, policy), max(mlp_columns(model, policy), default=0)),
            "linears": tuple((m.out_features, id(m) in columns) for m in block.modules() if isinstance(m, nn.Linear))}


def qk_norm(block, head_dim: int) -> str:
    """Whether ``block``'s attention normalises q and k: "head" (a norm of ``head_dim`` weights, per head), "full"
    (over the whole projection, OLMoE's), or ""."""
    norm = next((m for n, m in block.named_modules() if n.endswith("q_norm")), None)
    weight = getattr(norm, "weight", None)
    if weight is None:
        return ""
    return "head" if weight.numel() == head_dim else "full"


def rms_kind(block, hidden: int) -> str:
    """"rms32" where ``block``'s input norm keeps ``8 h + 4`` bytes a token in bf16 (an RMSNorm that multiplies by
    its weight in fp32, GPT-OSS's: its fp32 copy, 1/rms and the normed input in fp32), "rms" where ``6 h + 4``
    (Llama's: the normed input in bf16); "" otherwise (another norm, none, or one the fake tensors cannot run):
    the shape's default. Told apart by what the norm saves on bf16 inputs of 2 and 4 tokens
    (``fake.per_token``), whatever it holds besides that does not grow with the tokens (Qwen3-Next's ``1 +
    weight``)."""
    norm = getattr(block, "input_layernorm", None)
    if not isinstance(norm, nn.Module) or isinstance(norm, (nn.ModuleList, nn.ModuleDict)):
        return ""
    try:
        per, _ = per_token(norm, lambda n: (1, n, hidden), torch.bfloat16)
    except Exception:  # noqa: BLE001  # a norm that will not run alone on fake tensors: the default
        return ""
    return {8 * hidden + 4: "rms32", 6 * hidden + 4: "rms"}.get(per, "")


_ACTIVATIONS = ("act", "act_fn", "activation_fn", "activation")


def act_saves(mlp, width: int) -> int:
    """MLP-wide tensors the activation of ``mlp`` (the module holding the MLP's Linears) keeps beside its input
    and its output (the next Linear's input, counted there): its child named ``act``, ``act_fn``,
    ``activation_fn`` or ``activation``, traced on bf16 inputs of 2 and 4 rows of ``width``. 0 where there is
    none to trace (a function, not a module), as torch's GELU, SiLU and ReLU keep only their input or output.

        >>> from transformers.activations import NewGELUActivation
        >>> mlp = nn.Module(); mlp.act = NewGELUActivation()
        >>> act_saves(mlp, 64), act_saves(nn.Sequential(nn.Linear(8, 64), nn.ReLU()), 64)
        (3, 0)
    """
    if mlp is None or not width:
        return 0
    act = next((m for name, m in mlp.named_modules() if name.rsplit(".", 1)[-1] in _ACTIVATIONS), None)
    if not isinstance(act, nn.Module):
        return 0
    try:
        per_row, _ = per_token(act, lambda n: (n, width), torch.bfloat16, output=False)
    except Exception:  # noqa: BLE001  # an activation that will not run alone on fake tensors: none counted
        return 0
    return per_row // (2 * width)


def mlp_module(model, policy):
    """Block 0's MLP: the deepest module holding its column Linears outside attention (None without one)."""
    parents = [p.split(".")[:-1] for p, _ in _mlp_linears(model, policy)]
    return model.get_submodule(".".join(os.path.commonprefix(parents))) if parents else None
