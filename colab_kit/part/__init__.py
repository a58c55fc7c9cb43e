"""The shape every parallel part has: ``Part`` (a name, whether a config wants it, the rules it refuses by, the
step it takes in ``ck.parallelize``, its hooks in the training step) and ``Build`` (what the steps hand each
other on one rank). Each part declares its own in its folder (``colab_kit/<part>/part.py``: ``PART`` and its
``RULES``); ``engine.parts.PARTS`` is the one ordered tuple of them.

Adding a part: a folder with its code and a ``part.py`` declaring ``PART``, and one line in ``PARTS``. Worked
example, the tensor part on a 4-head GPT's facts (what ``boost`` and ``ck.plan`` both ask)::

    >>> from colab_kit import ParallelConfig
    >>> from colab_kit.tensor.part import PART
    >>> PART.name, PART.wants(ParallelConfig(tp=2), False), PART.wants(ParallelConfig(dp=2), False)
    ('tensor', True, False)
    >>> [r.name for r in PART.rules]
    ['split_gather_1d', 'attention_heads', 'split_gather_layers', 'tensor_sizes']
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError, ParallelConfig
from .rules import NotYet, Rule, broken, memo, needs, or_words, raised, rule, sentence

__all__ = ["Build", "EventLog", "HOOKS", "NotYet", "Part", "Rule", "broken", "memo", "needs", "or_words", "raised",
           "rule", "sentence"]


class EventLog(list):
    """The step's timeline events: a list of plain dicts (name, kind, start, end, ...), one per compute or comm
    event, cleared when a step begins. It holds no tensors, and says so (``holds_no_tensors``): the memory
    walks that run after every op (``memory.peak``) skip it instead of looking into each of its hundreds of
    dicts (a pp=2 1F1B step of 64 microbatches appends 258)."""

    holds_no_tensors = True


@dataclass
class Build:
    """What ``parallelize``'s steps hand each other on one rank: the model as the steps before left it, the
    plans they made, and, from ``materialize`` on, the ``module`` this rank runs. Each field is written by one
    step (named beside it) and read by the ones after."""

    model: Any  # nn.Module
    mesh: Any  # ProcessMesh
    config: ParallelConfig
    options: Any  # boost's keywords (engine.options.BoostOptions): policy, bucket_bytes, device_budget, ...
    loss: Callable  # the microbatch's loss as this layout computes it (precision wraps it)
    token_loss: Any = None
    group_of_name: Callable[[str], int] | None = None
    twin: Any = None  # the dense model on meta (defer_init)
    conv1d: tuple = ()  # Hugging Face Conv1D modules made Linear (defer_init)
    deferred: bool = False  # stages made from the meta twin, on their own ranks (defer_init)
    undo: list = field(default_factory=list)  # (dropout)
    tp_plan: Any = None  # (tensor)
    sp_plan: Any = None  # (sequence)
    stages: list | None = None  # (pipeline_split)
    tied: list = field(default_factory=list)  # weights the first and last stage share (pipeline_split)
    module: Any = None  # the nn.Module this rank runs (materialize on)
    n_local: int = 0  # its trainable elements (materialize)
    table: Any = None  # the PlacementTable (placements)
    events: list = field(default_factory=EventLog)  # the step's timeline events (every part appends)
    data_parallel: Any = None  # the data-parallel object: gradient sync, what the optimizer steps (data_parallel)
    steps: list = field(default_factory=list)  # the names of the steps taken

    @property
    def policy(self) -> Any:
        """What each part of the model is (``options.policy``, as ``check_policy`` found it)."""
        return self.options.policy


HOOKS = ("microbatch", "loss", "finish_grads", "after_optimizer", "after_step")
"""The training step's stages where parts work (``engine.step``, ``engine.finish``), in the step's order:
"microbatch" (``(step, microbatch) -> context manager``: what each microbatch's forward, backward and
recomputation run inside, the parts' contexts nested in the parts' order), "loss" (``(step, local) -> local``:
terms the reported loss adds), "finish_grads" (``(step, masters)``: after the gradient sync,
before the optimizer), "after_optimizer" (``(step, done)``), "after_step" (``(step, done)``: after the loss is
reduced). ``step`` is the engine's ``TrainingStep``, read by attribute."""


@dataclass(frozen=True, eq=False)
class Part:
    """One parallel part: ``name``; ``wants(config, dropout) -> bool`` (``dropout``: the model has dropout);
    ``rules`` (what it refuses given a config and the model's facts); ``apply(build)``, its step in
    ``parallelize`` (None: rules only); ``hooks``, its work in the training step by stage (``HOOKS``' names to a
    function of the step and the stage's value; each decides from the step whether it has work this time)."""

    name: str
    wants: Callable[[ParallelConfig, bool], bool] = lambda config, dropout: True
    rules: tuple[Rule, ...] = ()
    apply: Callable[[Build], None] | None = None
    hooks: dict = field(default_factory=dict)

    def __post_init__(self):
        unknown = set(self.hooks) - set(HOOKS)
        if unknown:
            raise ValueError(f"part {self.name!r} hooks {sorted(unknown)}: a hook's stage is one of {HOOKS}")

    def refuses(self, config: ParallelConfig, facts=None) -> ConfigError | None:
        """The first of this part's rules that ``config`` breaks for the model of ``facts`` (a ``ModelFacts``,
        or None: the rules that read the model are passed over), or None."""
        for _, why in broken(sorted(self.rules, key=lambda r: not r.not_yet), config, facts):
            return ConfigError(sentence([why]) if isinstance(why, NotYet) else why)
        return None
