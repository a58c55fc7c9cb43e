"""Sharding policies: what each part of a model is, by module path, as data.

A ``Policy`` is the one description of a model that every parallel part lowers: the tensor
modes (1d, 2d, 2.5d, 3d, split_gather) map each *role* to a layer of their own, the pipeline
cuts ``blocks``, sequence parallelism swaps the attention function named by ``Attention``,
recomputation and ZeRO-3 wrap each block. No parallel part names a model's attributes; the
built-in GPT, BERT and ViT use this same public API (``colab_kit.policy.builtin``).

Roles (``Policy.layers``: module path -> role; ``*`` stands for every block index):

==========  =====================  ================================================================
role        module                 what it is
==========  =====================  ================================================================
vocab       nn.Embedding           the token table: split over the vocabulary
positions   nn.Embedding           a table looked up by token position (``arange(t)``)
table       nn.Embedding           a small table looked up by ids every rank holds (token type,
                                   a class token looked up with zeros): split by features
input       nn.Linear              a Linear on the raw input (ViT's patch embedding)
column      nn.Linear              the first Linear of a pair (q/k/v, the MLP's up projections)
row         nn.Linear              the second (attention out, the MLP's down projection)
dense       nn.Linear              a width-keeping Linear on the residual (BERT's MLM transform)
norm        nn.LayerNorm           a LayerNorm over the residual's features
rmsnorm     a module with          an RMSNorm over the residual's features (``weight * x /
            ``weight``, ``eps`` or rms(x)``, statistics in fp32: Llama's)
            ``variance_epsilon``
head        nn.Linear              the output projection (vocabulary or classes); its logits stay
                                   split for the vocab-parallel cross-entropy
rotary      a module called as     rotary position embeddings (Llama's ``rotary_emb``): sequence
            ``(x, position_ids)``  parallelism hands it this rank's global positions
==========  =====================  ================================================================

Write one for your own model in about twenty lines (the README shows the same)::

    import colab_kit as ck
    from colab_kit.policy import Attention, Policy

    class Net(nn.Module):                       # attributes named unlike GPT's
        def __init__(self):
            super().__init__()
            self.words = nn.Embedding(64, 32); self.where = nn.Embedding(16, 32)
            self.layers = nn.ModuleList(MyBlock() for _ in range(4))   # .mix (attn), .ff, .n1, .n2
            self.norm = nn.LayerNorm(32); self.out = nn.Linear(32, 64)
        def forward(self, ids):
            x = self.words(ids) + self.where(torch.arange(ids.shape[1]))
            for layer in self.layers:
                x = layer(x)
            return self.out(self.norm(x))

    policy = Policy(
        blocks="layers",
        layers={"words": "vocab", "where": "positions", "norm": "norm", "out": "head",
                "layers.*.n1": "norm", "layers.*.n2": "norm",
                "layers.*.mix.qkv": "column", "layers.*.mix.o": "row",
                "layers.*.ff.up": "column", "layers.*.ff.down": "row"},
        attention={"layers.*.mix": Attention(heads=("n_heads",), attend="attend")},
        embed=lambda m, ids: m.words(ids) + m.where(torch.arange(ids.shape[1], device=ids.device)),
        finish=lambda m, x: m.out(m.norm(x)),
        tail=("norm", "out"))
    engine = ck.boost(Net(), opt, ck.ParallelConfig(tp=2, pp=2), policy=policy)

What each rank sees, tp=2 (1d) with that policy: ``words`` becomes a ``VocabEmbedding`` holding
tokens 0..31 on tp rank 0 and 32..63 on rank 1; ``mix.qkv`` and ``ff.up`` ``ColumnLinear`` (whole
heads each), ``mix.o`` and ``ff.down`` ``RowLinear``; ``out`` a ``ColumnLinear`` whose logits the
engine's vocab-parallel loss reads; ``mix.n_heads`` is halved, so the model's own ``view(b, t,
self.n_heads, d)`` reshapes the local heads. With pp=2, pipeline rank 0 runs ``embed`` and layers
0-1; rank 1 runs layers 2-3 and ``finish``.

``Policy.check(model)`` says which paths are missing or of the wrong kind; a model without a
policy under tp, pp or sp is refused with a message that shows how to write one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable

import torch.nn as nn

from ..config import ConfigError

__all__ = ["Attention", "Policy", "ROLES", "register", "policy_for", "find", "get_module", "set_module",
           "missing_policy_message"]

ROLES = {"vocab": nn.Embedding, "positions": nn.Embedding, "table": nn.Embedding, "input": nn.Linear,
         "column": nn.Linear, "row": nn.Linear, "dense": nn.Linear, "norm": nn.LayerNorm, "rmsnorm": nn.Module,
         "head": nn.Linear, "rotary": nn.Module}
"""Each role and the kind of dense module it names."""

LOSSES = ("tokens", "classes")


@dataclass(frozen=True)
class Attention:
    """What the parallel parts need to know of one attention module.

    ``heads`` / ``kv_heads``: names of the module's attributes holding its (query / key-value) head
    counts; a tensor mode that splits heads divides them, so the model's own reshapes see the local
    count. ``attend``: the name of its method ``attend(q, k, v) -> out`` on ``[b, heads, t, head_dim]``,
    which sequence parallelism replaces on the instance. ``causal``: whether it masks future tokens.
    """

    heads: tuple[str, ...] = ()
    kv_heads: tuple[str, ...] = ()
    attend: str | None = None
    causal: bool = True
    widths: tuple[str, ...] = ()
    """Attributes holding a width in features of the local q/k/v (GPT-2's ``split_size``): divided
    like the heads."""
    n_heads: int = 0
    """The head count, where the module keeps none in an attribute (Llama reshapes with -1)."""
    n_kv_heads: int = 0
    """The key/value head count (grouped-query attention), likewise."""
    hf: bool = False
    """The module calls ``transformers``' attention-function registry (``config._attn_implementation``):
    sequence parallelism registers its ring / all-to-all function there instead of replacing ``attend``."""


@dataclass(frozen=True)
class Policy:
    """How to shard one model family (see the module docstring for the roles and an example).

    ``blocks``: path of the ``nn.ModuleList`` of blocks (where a pipeline may cut, what recomputation
    and ZeRO-3 wrap). ``layers``: path (``*`` = every block index) -> role. ``attention``: path of each
    attention module -> ``Attention``. ``embed(model, inputs) -> hidden`` and ``finish(model, hidden)
    -> logits``: the model's code before and after the blocks (a pipeline's first and last stage run
    them on their part of the model). ``tail``: the modules ``finish`` uses (the last stage holds them;
    everything else outside the blocks goes with the first). ``loss``: "tokens" (mean cross-entropy
    over every target that is not -100, over the whole batch) or "classes" (logits ``[b, C]``, targets
    ``[b]``). ``tied``: pairs ``(table path, head path)`` of modules sharing one weight (a head tied to
    the token table). ``context(model, inputs) -> dict``: keyword arguments every block gets, made from
    the batch's inputs on every pipeline stage (BERT's padding mask), or None.
    """

    blocks: str
    layers: dict[str, str]
    embed: Callable
    finish: Callable
    attention: dict[str, Attention] = field(default_factory=dict)
    tail: tuple[str, ...] = ()
    loss: str = "tokens"
    tied: tuple[tuple[str, str], ...] = ()
    context: Callable | None = None
    fused: dict[str, int] = field(default_factory=dict)
    """Column Linears whose output features are ``k`` equal parts used apart (GPT-2's ``c_attn``:
    ``[q | k | v]``): each part is split on its own, so a rank holds ``[q_i | k_i | v_i]``."""
    prepare: Callable | None = None
    """``prepare(model)``, run once by ``boost`` on the dense model before anything else (a Hugging Face
    GPT-2's ``Conv1D`` layers become ``nn.Linear``s), or None."""
    output: Callable | None = None
    """Maps what ``model(inputs)`` returns to the logits (a Hugging Face output's ``.logits``), or None."""
    everywhere: tuple[str, ...] = ()
    """Parameterless modules every pipeline stage keeps (Llama's rotary embedding)."""
    sequence: bool = True
    """Whether the inputs are token sequences (dim 1), which sequence parallelism splits (ViT's images: no)."""
    experts: tuple[str, ...] = ()
    """Paths of the mixture-of-experts layers: modules whose expert tensors are stacked with the expert as
    dim 0 (``colab_kit.models.experts.Experts``, or ``transformers``' fused ``gate_up_proj`` / ``down_proj``). The
    engine refuses the modes that would split their inputs (tp, sp); expert parallelism slices dim 0."""
    name: str = ""

    def __post_init__(self):
        bad = {p: r for p, r in self.layers.items() if r not in ROLES}
        if bad:
            raise ValueError(f"unknown roles {bad}: each layer's role is one of {', '.join(ROLES)}")
        if self.loss not in LOSSES:
            raise ValueError(f"Policy.loss must be one of {LOSSES}, got {self.loss!r}")

    # ------------------------------------------------------------------ reading a model
    def block_list(self, model: nn.Module) -> nn.ModuleList:
        blocks = get_module(model, self.blocks)
        if not isinstance(blocks, nn.ModuleList):
            raise ConfigError(f"policy {self.name or '?'}: {self.blocks!r} is a {type(blocks).__name__}, "
                              "not the nn.ModuleList of blocks")
        return blocks

    def tail_modules(self, model: nn.Module) -> list[nn.Module]:
        """The modules of ``tail`` (what ``finish`` uses), in the policy's order."""
        return [get_module(model, path) for path in self.tail]

    def modules(self, model: nn.Module, role: str | None = None) -> list[tuple[str, str, nn.Module]]:
        """``(path, role, module)`` of every layer the policy names, blocks expanded, in the model's own
        module order (block by block: a meta model's shards are then made in the order it runs)."""
        n = len(self.block_list(model))
        out = []
        for pattern, r in self.layers.items():
            if role is None or r == role:
                out += [(p, r, get_module(model, p)) for p in expand(pattern, self.blocks, n)]
        order = {id(m): i for i, m in enumerate(model.modules())}
        return sorted(out, key=lambda e: order.get(id(e[2]), len(order)))

    def attentions(self, model: nn.Module) -> list[tuple[str, nn.Module, Attention]]:
        n = len(self.block_list(model))
        return [(p, get_module(model, p), a) for pattern, a in self.attention.items()
                for p in expand(pattern, self.blocks, n)]

    def check(self, model: nn.Module, kinds: bool = True) -> None:
        """ConfigError naming every path of the policy that ``model`` lacks or (``kinds``: on the dense
        model, before a tensor plan replaced its layers) that is of the wrong kind."""
        problems = []
        try:
            n = len(self.block_list(model))
        except (AttributeError, ConfigError) as e:
            raise ConfigError(f"policy {self.name or '?'} does not fit {type(model).__name__}: {e}") from None
        def found(pattern: str, what: str):
            for path in expand(pattern, self.blocks, n):
                try:
                    yield path, get_module(model, path)
                except AttributeError:
                    problems.append(f"{what.format(path=path)} is missing")

        for pattern, role in self.layers.items():
            for path, mod in found(pattern, f"{{path}} ({role})"):
                if kinds and not isinstance(mod, ROLES[role]):
                    problems.append(f"{path} is {type(mod).__name__}, where role {role!r} needs "
                                    f"nn.{ROLES[role].__name__}")
                elif kinds and role == "rmsnorm" and not (hasattr(mod, "weight") and
                                                          (hasattr(mod, "eps") or hasattr(mod, "variance_epsilon"))):
                    problems.append(f"{path} (rmsnorm) has no weight and eps (or variance_epsilon)")
        for pattern, att in self.attention.items():
            for path, mod in found(pattern, "attention {path}"):
                for a in (*att.heads, *att.kv_heads, *att.widths, *((att.attend,) if att.attend else ())):
                    if not hasattr(mod, a):
                        problems.append(f"attention {path} has no attribute {a!r}")
        for path in self.tail:
            list(found(path, "tail module {path}"))
        for path in self.experts:
            list(found(path, "experts {path}"))
        if problems:
            raise ConfigError(f"policy {self.name or '?'} does not fit {type(model).__name__}: " + "; ".join(problems))

    def head_count(self, model: nn.Module) -> dict[str, int]:
        """``{"heads": n, "kv_heads": m}`` of the first attention (0 when the policy names none)."""
        atts = self.attentions(model)
        if not atts:
            return {"heads": 0, "kv_heads": 0}
        _, mod, att = atts[0]
        heads = getattr(mod, att.heads[0]) if att.heads else att.n_heads
        kv = getattr(mod, att.kv_heads[0]) if att.kv_heads else (att.n_kv_heads or heads)
        return {"heads": heads, "kv_heads": kv}


# ---------------------------------------------------------------------- paths
def expand(pattern: str, blocks: str, n_blocks: int) -> list[str]:
    """``"blocks.*.attn"`` -> ``["blocks.0.attn", ...]``; a path without ``*`` is itself."""
    if "*" not in pattern:
        return [pattern]
    if not pattern.startswith(blocks + ".*"):
        raise ValueError(f"{pattern!r}: '*' stands for a block index, so the path must start with {blocks!r}.*")
    return [pattern.replace("*", str(i), 1) for i in range(n_blocks)]


def get_module(model: nn.Module, path: str) -> nn.Module:
    """The module at dotted ``path`` (``""`` is the model); AttributeError naming what is missing."""
    mod = model
    for part in filter(None, path.split(".")):
        child = mod._modules.get(part) if isinstance(mod, nn.Module) else None
        if child is None:
            raise AttributeError(f"{type(model).__name__} has no module {path!r} (no {part!r} in "
                                 f"{type(mod).__name__})")
        mod = child
    return mod


def set_module(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(get_module(model, parent), name, new)


# ---------------------------------------------------------------------- registry
_REGISTRY: dict[type, Callable[[nn.Module], Policy]] = {}
_LAZY: dict[str, str] = {  # "module:Class" of a model family -> "module:factory", loaded on first use
    "colab_kit.models.gpt:GPT": "colab_kit.policy.builtin:gpt_policy",
    "colab_kit.models.bert:BERT": "colab_kit.policy.builtin:bert_policy",
    "colab_kit.models.vit:ViT": "colab_kit.policy.builtin:vit_policy",
    "transformers.models.gpt2.modeling_gpt2:GPT2LMHeadModel": "colab_kit.policy.hf:gpt2_policy",
    **{k: "colab_kit.policy.hf:llama_policy" for k in (  # Llama and its kin (colab_kit.policy.hf.LLAMA_LIKE)
        "transformers.models.llama.modeling_llama:LlamaForCausalLM",
        "transformers.models.mistral.modeling_mistral:MistralForCausalLM",
        "transformers.models.qwen2.modeling_qwen2:Qwen2ForCausalLM",
        "transformers.models.qwen3.modeling_qwen3:Qwen3ForCausalLM")},
    **{k: "colab_kit.policy.hf_moe:hf_moe_policy" for k in (  # mixtures of experts (colab_kit.policy.hf_moe)
        "transformers.models.mixtral.modeling_mixtral:MixtralForCausalLM",
        "transformers.models.qwen3_moe.modeling_qwen3_moe:Qwen3MoeForCausalLM",
        "transformers.models.qwen2_moe.modeling_qwen2_moe:Qwen2MoeForCausalLM",
        "transformers.models.olmoe.modeling_olmoe:OlmoeForCausalLM",
        "transformers.models.deepseek_v3.modeling_deepseek_v3:DeepseekV3ForCausalLM",
        "transformers.models.gpt_oss.modeling_gpt_oss:GptOssForCausalLM")},
}


def register(model_class: type, policy: Callable[[nn.Module], Policy] | Policy) -> None:
    """Use ``policy`` (or ``policy(model)``) for every instance of ``model_class`` (and its subclasses)."""
    _REGISTRY[model_class] = policy if callable(policy) and not isinstance(policy, Policy) else (lambda m: policy)


def policy_for(model: nn.Module, policy: Policy | None = None) -> Policy | None:
    """``policy`` when given, else the registered one of ``model``'s class (or a base), else None."""
    if policy is not None:
        if not isinstance(policy, Policy):
            raise TypeError(f"policy must be a colab_kit.policy.Policy, got {type(policy).__name__}")
        return policy
    for cls in type(model).__mro__:
        if cls in _REGISTRY:
            return _REGISTRY[cls](model)
        key = f"{cls.__module__}:{cls.__qualname__}"
        if key in _LAZY:
            import importlib
            mod, fn = _LAZY[key].split(":")
            return getattr(importlib.import_module(mod), fn)(model)
    return None


def missing_policy_message(model: nn.Module | str, needs: str) -> str:
    """Why ``needs`` (e.g. "tp=2 and pp=2") cannot run ``model`` (or a model class of that name) without a policy."""
    name = model if isinstance(model, str) else type(model).__name__
    return (f"{needs} needs a sharding policy for {name}, and colab_kit has none built in (it has GPT, BERT, "
            f"ViT, and transformers' GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
            f"Qwen3ForCausalLM and the MoE causal LMs of "
            f"colab_kit.policy.hf_moe): pass ck.boost(model, opt, config, "
            f"policy=Policy(blocks='<path of the nn.ModuleList of blocks>', layers={{'<path>': '<role>', "
            f"'<blocks>.*.<attention q/k/v>': 'column', '<blocks>.*.<attention out>': 'row', ...}}, "
            f"attention={{'<blocks>.*.<attention>': Attention(heads=('<head-count attribute>',))}}, "
            f"embed=lambda m, x: ..., finish=lambda m, h: ..., tail=(...)) (roles: {', '.join(ROLES)}; "
            f"a worked example: help(colab_kit.policy)), or use only dp and zero for this model")

