"""``ParallelConfig``: every parallel degree and mode, validated when it is built.

A config is a frozen dataclass. Building one checks every rule at once, so an
invalid choice is refused in the notebook kernel before any process is touched::

    >>> import colab_kit as ck
    >>> ck.ParallelConfig(dp=2, tp=4, tp_mode="2d").world_size
    8
    >>> ck.ParallelConfig(tp=6, tp_mode="2d")
    Traceback (most recent call last):
    ...
    colab_kit.config.ConfigError: tp=6 with tp_mode='2d' needs tp to be a square (q*q): try 4 or 9

The same config can be parsed from the words a magic receives, as ``key=value``
words or as ``--key value`` flags (``ParallelConfig.parse("dp=2 --tp 2")``).
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import operator
import shlex
import sys
from dataclasses import dataclass
from collections.abc import Iterable

from .errors import MessageOnly

__all__ = ["Axis", "ConfigError", "ParallelConfig", "TP_MODES", "SP_MODES", "SCHEDULES", "RECOMPUTES"]

if sys.version_info >= (3, 11):
    from enum import StrEnum as _StrEnum
else:  # Python 3.10 has no StrEnum: the same behaviour, spelled out
    class _StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str.__str__(self)

        def __format__(self, format_spec: str) -> str:
            return str.__format__(self, format_spec)


class Axis(_StrEnum):
    """The names of the mesh axes, written once (``MeshLayout`` / ``ProcessMesh`` take them).

    - ``PP``: pipeline stages (slowest varying in the rank order).
    - ``DP``: data-parallel replicas, over which dense gradients are averaged.
    - ``SP``: sequence-parallel ranks, each holding a slice of the tokens.
    - ``TP``: the tensor-parallel block (fastest varying), split 1D or into the sub-axes below.
    - ``EP``: expert-parallel ranks, each holding a share of the experts (tokens exchanged by all-to-all).
    - ``EDP``: the data-parallel ranks that hold the same experts, over which expert gradients are summed
      (``EP`` and ``EDP`` fold the ``DP`` x ``SP`` block).
    - ``DP_SP``: the ``DP`` x ``SP`` block flattened (``dp_i * sp + sp_i``): the ranks that hold the same
      weights, over which data parallelism reduces and ZeRO shards them when ``sp > 1`` (``colab_kit.zero``).
    - ``TP_ROW`` / ``TP_COL``: the 2D / 2.5D tensor grid's rows and columns; ``TP_DEP``: its depth in 2.5D.
    - ``TP_IN``: the 3D tensor cube's input axis (a first Linear all-gathers its input over it).
    - ``TP_WT``: the 3D cube's weight axis (weights all-gathered over it; it never changes role).
    - ``TP_OUT``: the 3D cube's output axis (a first Linear reduce-scatters its product over it).

    Members are ``str`` (``Axis.DP == "dp"``, same hash, ``str`` and ``f"{}"`` give ``"dp"``, JSON writes
    ``"dp"``) and their repr is the plain string's, so every function taking an axis name keeps taking a
    plain string, and dicts, tuples and messages holding axes read as before::

        >>> Axis.DP == "dp", f"{Axis.EDP}", {"tp": 2}[Axis.TP], Axis("tp_row")
        (True, 'edp', 2, 'tp_row')
    """

    PP = "pp"
    DP = "dp"
    SP = "sp"
    TP = "tp"
    EP = "ep"
    EDP = "edp"
    DP_SP = "dp_sp"
    TP_ROW = "tp_row"
    TP_COL = "tp_col"
    TP_DEP = "tp_dep"
    TP_IN = "tp_in"
    TP_WT = "tp_wt"
    TP_OUT = "tp_out"

    def __repr__(self) -> str:
        return repr(self.value)


TP_MODES = ("1d", "2d", "2.5d", "3d")
SP_MODES = ("ring", "ulysses", "split_gather")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
OFFLOADS = ("none", "cpu", "auto")
PRECISIONS = ("fp32", "fp16", "bf16")
RECOMPUTES = ("none", "selective", "op", "full")
"""What ``recompute`` may be (``colab_kit.recompute``): True / False are read as "full" / "none"."""
AXES = (Axis.PP, Axis.DP, Axis.SP, Axis.TP)  # slowest to fastest varying in the rank order
_BOOL_FIELDS = ("recompute",)
_WORDS_TRUE, _WORDS_FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class ConfigError(MessageOnly, ValueError):
    """An invalid parallel configuration; the message names the rule and a valid choice
    (IPython shows the message, not the kernel-side frames)."""


def _recompute_mode(value) -> str:
    """``recompute`` as one of ``RECOMPUTES``: True / 1 / "on" -> "full", False / 0 / "off" -> "none".

    >>> _recompute_mode(True), _recompute_mode("off"), _recompute_mode("Selective")
    ('full', 'none', 'selective')
    """
    if isinstance(value, str):
        word = value.strip().lower()
        if word in RECOMPUTES:
            return word
        if word in _WORDS_TRUE + _WORDS_FALSE:
            return "full" if word in _WORDS_TRUE else "none"
    elif value is True or value is False or (not isinstance(value, float) and value in (0, 1)):
        return "full" if value else "none"   # bool, numpy's bool_, 0 / 1
    near = difflib.get_close_matches(str(value).lower(), RECOMPUTES, n=1)
    hint = f"did you mean {near[0]!r}?" if near else "try recompute='selective'"
    raise ConfigError(f"recompute must be 'none', 'selective', 'op' or 'full' (or True / False for 'full' / 'none'), "
                      f"got {value!r}: {hint}")


def _nearest(n: int, ok) -> list[int]:
    """The valid values closest to ``n`` (one below and one above when they exist)."""
    below = next((k for k in range(n - 1, 0, -1) if ok(k)), None)
    above = next(k for k in range(n + 1, 64 * n + 2) if ok(k))
    return [k for k in (below, above) if k is not None]


def _is_square(n: int) -> bool:
    return math.isqrt(n) ** 2 == n


def _cube_root(n: int) -> int | None:
    q = round(n ** (1 / 3))
    return next((k for k in (q - 1, q, q + 1) if k > 0 and k ** 3 == n), None)


def _or(values: Iterable) -> str:
    values = [str(v) for v in values]
    return " or ".join(values) if len(values) < 3 else ", ".join(values[:-1]) + " or " + values[-1]


@dataclass(frozen=True)
class ParallelConfig:
    """How one training job is split over ``world_size = dp * pp * sp * tp`` ranks."""

    dp: int = 1
    """Data-parallel degree: replicas that each see ``1/dp`` of the global batch."""
    tp: int = 1
    """Tensor-parallel degree: ranks that share every weight matrix."""
    pp: int = 1
    """Pipeline-parallel degree: stages the model's blocks are split into."""
    sp: int = 1
    """Sequence-parallel degree for ``sp_mode`` 'ring' or 'ulysses' (ranks that split the sequence)."""
    tp_mode: str = "1d"
    """'1d' (Megatron), '2d' (SUMMA, tp = q*q), '2.5d' (Tesseract, tp = depth*q*q) or '3d' (tp = q**3)."""
    tp_depth: int = 1
    """Depth d of the 2.5D mode; only meaningful with tp_mode='2.5d'."""
    sp_mode: str = "ring"
    """'ring' (ring self-attention), 'ulysses' (all-to-all) or 'split_gather' (Megatron SP inside tp)."""
    zero: int = 0
    """ZeRO stage: 0 off, 1 optimizer states, 2 + gradients, 3 + parameters sharded over dp (over dp x sp
    with sequence parallelism: ``zero_ranks``)."""
    offload: str = "none"
    """'none'; 'cpu': ZeRO's sharded optimizer states and the update in host memory (ZeRO-Offload);
    'auto' (zero=3): each chunk on the device or the host under ``boost(..., device_budget=BYTES)``,
    placed from the first step's measured use (``colab_kit.zero.offload``)."""
    microbatches: int = 1
    """Microbatches per step (pipeline microbatches, or gradient accumulation when pp=1)."""
    schedule: str = "1f1b"
    """Pipeline schedule: 'gpipe', '1f1b', 'interleaved', 'zb-h1' or 'zb-v'."""
    chunks: int = 1
    """Model chunks per pipeline rank (virtual stages): > 1 with schedule='interleaved', exactly 2 with 'zb-v'."""
    precision: str = "fp32"
    """'fp32', 'fp16' or 'bf16'."""
    ep: int = 1
    """Expert-parallel degree: the experts of each mixture-of-experts layer split over ``ep`` ranks folded over
    the ``dp x sp`` ranks (they add no rank: ``world_size`` stays ``dp * pp * sp * tp``); ``ep`` must divide
    ``dp * sp``. Tokens go to their experts' ranks by all-to-all; an expert's gradients are summed over the
    ``dp * sp / ep`` ranks that hold the same experts (the ``edp`` axis). ``colab_kit.expert``."""
    recompute: str = "none"
    """Activation recomputation (``colab_kit.recompute``): "none" keeps every activation; "selective"
    recomputes attention's core (scores, softmax, dropout, times V: Korthikanti et al. 2022) in backward;
    "op" runs each block under per-op selective checkpointing (torchtitan's): it keeps its input, the
    attention kernel's output and log-sum-exp and every second matmul's output (GPT: qkv's and fc1's), and
    recomputes the rest (``colab_kit.recompute.op``; not with tp_mode '2d' / '2.5d'); "full" recomputes each
    transformer block, which keeps only its input. True / False (and the words true / on / false / off) are
    stored as "full" / "none"."""

    def __new__(cls, *args, **kwargs):
        """Refuse an unknown keyword as ``from_dict`` does, with the field it was likely meant to be (the
        dataclass's own ``__init__`` would raise a bare TypeError).

        >>> ParallelConfig(dp=2, microbatch=4)
        Traceback (most recent call last):
        ...
        colab_kit.config.ConfigError: unknown config key 'microbatch': did you mean 'microbatches'?
        """
        unknown = [k for k in kwargs if k not in _FIELDS]
        if unknown:
            near = difflib.get_close_matches(unknown[0], _FIELDS, n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"known keys: {', '.join(_FIELDS)}"
            raise ConfigError(f"unknown config key {unknown[0]!r}: {hint}")
        return super().__new__(cls)

    def __post_init__(self):
        object.__setattr__(self, "recompute", _recompute_mode(self.recompute))
        self._check()

    # ------------------------------------------------------------------ derived
    @property
    def world_size(self) -> int:
        """Number of ranks this config needs: ``dp * pp * sp * tp``."""
        return self.dp * self.pp * self.sp * self.tp

    @property
    def shape(self) -> dict[str, int]:
        """Axis sizes in rank order, slowest first: ``{"pp", "dp", "sp", "tp"}``."""
        return {a: getattr(self, a) for a in AXES}

    @property
    def zero_ranks(self) -> int:
        """The ranks that hold the same weights: ``dp * sp`` (sp ranks see other tokens of the same rows). Data
        parallelism reduces the gradients over them (a mean over dp, a sum over sp), and ZeRO shards the
        optimizer states, gradients (stage 2) and parameters (stage 3) ``1 / (dp * sp)`` a rank, as
        Megatron-Core's distributed optimizer (dp x cp) and torchtitan's FSDP (dp_shard x cp) do.

        >>> ParallelConfig(dp=2, sp=2, zero=1).zero_ranks, ParallelConfig(dp=4, tp=2).zero_ranks
        (4, 4)
        """
        return self.dp * self.sp

    @property
    def tp_q(self) -> int:
        """Side q of the tensor grid: tp for 1d, sqrt(tp/d) for 2d/2.5d, cbrt(tp) for 3d."""
        if self.tp_mode == "1d":
            return self.tp
        if self.tp_mode == "3d":
            q = _cube_root(self.tp)
            assert q is not None  # a 3d config's tp is a cube (checked when it was built)
            return q
        return math.isqrt(self.tp // self.tp_depth)

    def replace(self, **changes) -> ParallelConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """Short human form: the degrees, then every field that is not its default, so two
        different configs never read alike::

            dp=2 x tp=4 (2d) = 8 ranks
            dp=2 x pp=2 = 4 ranks, zb-v x 8 microbatches, 2 chunks, zero=2, bf16, recompute
        """
        parts = [f"{a}={getattr(self, a)}" for a in ("dp", "pp", "sp", "tp") if getattr(self, a) > 1]
        if self.tp > 1:
            parts[-1] += f" ({self.tp_mode}" + (f", depth {self.tp_depth})" if self.tp_mode == "2.5d" else ")")
        text = (" x ".join(parts) or "single rank") + f" = {self.world_size} rank" + "s" * (self.world_size > 1)
        extra = []
        if self.sp_mode == "split_gather" or (self.sp > 1 and self.sp_mode != "ring"):
            extra.append(self.sp_mode)
        if self.pp > 1 and (self.schedule != "1f1b" or self.microbatches > 1):
            extra.append(f"{self.schedule} x {self.microbatches} microbatch" + "es" * (self.microbatches > 1))
        elif self.microbatches > 1:
            extra.append(f"{self.microbatches} microbatches")
        if self.chunks > 1:
            extra.append(f"{self.chunks} chunks")
        if self.ep > 1:
            extra.append(f"ep={self.ep}")
        extra += [f"zero={self.zero}"] * (self.zero > 0) + [f"offload={self.offload}"] * (self.offload != "none")
        extra += [self.precision] * (self.precision != "fp32")
        extra += {"none": [], "full": ["recompute"], "selective": ["selective recompute"],
                  "op": ["op recompute"]}.get(self.recompute, [])
        return ", ".join([text, *extra])

    def check_world_size(self, n: int) -> None:
        """Raise ConfigError unless this config fits exactly ``n`` ranks."""
        if self.world_size == n:
            return
        rest = self.world_size // self.dp
        hint = f"dp={n // rest}" if n >= rest and n % rest == 0 else None
        msg = (f"this config needs dp*pp*sp*tp = {self.dp}*{self.pp}*{self.sp}*{self.tp} = "
               f"{self.world_size} ranks, but there are {n}")
        raise ConfigError(msg + (f": try {hint}" if hint else f": choose degrees whose product is {n}"))

    # ------------------------------------------------------------------ parsing
    @classmethod
    def parse(cls, words: str | list[str], base: ParallelConfig | None = None) -> ParallelConfig:
        """Build a config from ``"dp=2 tp=4 tp_mode=2d"`` or ``"--dp 2 --tp 4 --tp-mode 2d"``.

        Unknown keys and unparsable values raise ConfigError naming the nearest key, and so
        does a key given twice (``dp=2 dp=4``, ``dp=2 --dp 4``): which one was meant is unclear.
        Fields not given keep their value in ``base`` (or the default).
        """
        if isinstance(words, str):
            words = shlex.split(words)
        values: dict[str, str] = {}
        given: dict[str, str] = {}
        i = 0
        while i < len(words):
            word = words[i]
            if word.startswith("--"):
                key = word[2:]
                if "=" in key:
                    key, value = key.split("=", 1)
                elif key.replace("-", "_") in _BOOL_FIELDS:  # a switch: --recompute, --recompute off / selective
                    following = words[i + 1].lower() if i + 1 < len(words) else ""
                    named = following in _WORDS_TRUE + _WORDS_FALSE + RECOMPUTES
                    value, i = (words[i + 1], i + 1) if named else ("true", i)
                elif i + 1 < len(words) and not words[i + 1].startswith("--"):
                    value, i = words[i + 1], i + 1
                else:
                    raise ConfigError(f"flag {word} needs a value, e.g. {word} 2")
            elif "=" in word:
                key, value = word.split("=", 1)
            else:
                raise ConfigError(f"cannot read {word!r}: write key=value (dp=2) or a flag (--dp 2)")
            name, said = key.replace("-", "_"), word if "=" in word else f"{word} {value}"
            if name in values:
                raise ConfigError(f"config key {name!r} given twice, as {given[name]} and as {said}: give it once")
            values[name], given[name] = value, said
            i += 1
        return cls.from_dict(values, base=base)

    @classmethod
    def from_dict(cls, values: dict, base: ParallelConfig | None = None) -> ParallelConfig:
        """Build a config from a mapping of field names to values (strings are converted)."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = dict(base.to_dict()) if base is not None else {}
        for key, value in values.items():
            if key not in fields:
                near = difflib.get_close_matches(key, fields, n=1)
                hint = f"did you mean {near[0]!r}?" if near else f"known keys: {', '.join(fields)}"
                raise ConfigError(f"unknown config key {key!r}: {hint}")
            if fields[key].type == "int" and isinstance(value, str):
                try:
                    value = int(value)
                except ValueError:
                    raise ConfigError(f"{key} must be a whole number, got {value!r}") from None
            elif fields[key].type == "int" and not isinstance(value, (int, bool)):
                try:  # numpy integers and the like; 2.5 stays 2.5 and is refused by the rules
                    value = operator.index(value)
                except TypeError:
                    pass
            elif key == "recompute":
                value = _recompute_mode(value)
            elif fields[key].type == "str":
                value = str(value).lower()
            elif fields[key].type == "bool" and isinstance(value, str):
                word = value.strip().lower()
                if word not in _WORDS_TRUE + _WORDS_FALSE:
                    raise ConfigError(f"{key} must be true or false, got {value!r}")
                value = word in _WORDS_TRUE
            elif fields[key].type == "bool" and not isinstance(value, bool) and value in (0, 1):
                value = bool(value)  # 0 / 1, numpy's bool_
            kwargs[key] = value
        return cls(**kwargs)

    # ------------------------------------------------------------------ rules
    def _check(self) -> None:
        for name in ("dp", "tp", "pp", "sp", "ep", "tp_depth", "microbatches", "chunks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive whole number, got {v!r}: try {name}=1")
        for name, allowed in (("tp_mode", TP_MODES), ("sp_mode", SP_MODES), ("schedule", SCHEDULES),
                              ("offload", OFFLOADS), ("precision", PRECISIONS)):
            v = getattr(self, name)
            if v not in allowed:
                near = difflib.get_close_matches(str(v).lower(), allowed, n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise ConfigError(f"unknown {name} {v!r}: {hint}choose one of {_or(repr(a) for a in allowed)}")
        if isinstance(self.zero, bool) or not isinstance(self.zero, int) or self.zero not in (0, 1, 2, 3):
            raise ConfigError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        self._check_tensor()
        self._check_recompute()
        self._check_sequence()
        self._check_pipeline()
        self._check_experts()
        if self.offload != "none" and self.zero == 0:
            raise ConfigError(f"offload={self.offload!r} moves ZeRO's sharded optimizer states to the host, "
                              "so it needs zero >= 1: try zero=1")
        if self.offload == "auto" and self.zero != 3:
            raise ConfigError(f"offload='auto' places ZeRO-3's parameter chunks between device and host, so it needs "
                              f"zero=3 (got zero={self.zero}): try zero=3, or offload='cpu' with zero={self.zero}")

    def _check_tensor(self) -> None:
        tp, mode, d = self.tp, self.tp_mode, self.tp_depth
        if mode != "2.5d" and d != 1:
            raise ConfigError(f"tp_depth={d} applies only to tp_mode='2.5d' (tp = depth*q*q): "
                              f"set tp_depth=1 or tp_mode='2.5d'")
        if mode == "2d" and not _is_square(tp):
            raise ConfigError(f"tp={tp} with tp_mode='2d' needs tp to be a square (q*q): "
                              f"try {_or(_nearest(tp, _is_square))}")
        if mode == "2.5d" and (tp % d or not _is_square(tp // d)):
            ok = _nearest(tp, lambda n: n % d == 0 and _is_square(n // d))
            raise ConfigError(f"tp={tp} with tp_mode='2.5d' and tp_depth={d} needs tp = depth*q*q: "
                              f"try tp={_or(ok)} (q = {_or(math.isqrt(k // d) for k in ok)})")
        if mode == "3d" and _cube_root(tp) is None:
            raise ConfigError(f"tp={tp} with tp_mode='3d' needs tp to be a cube (q*q*q): "
                              f"try {_or(_nearest(tp, lambda n: _cube_root(n) is not None))}")

    def _check_recompute(self) -> None:
        if self.recompute == "op" and self.tp > 1 and self.tp_mode in ("2d", "2.5d"):
            raise ConfigError(f"recompute='op' keeps every second matmul's output, and tp_mode={self.tp_mode!r} "
                              f"(SUMMA) adds each step's product into the first one's in place, which would change a "
                              f"kept output: use recompute='op' with tp_mode='1d' or '3d', or recompute='selective' or "
                              f"'full' with tp_mode={self.tp_mode!r}")

    def _check_sequence(self) -> None:
        if self.sp_mode == "split_gather":
            if self.tp == 1:
                raise ConfigError("sp_mode='split_gather' splits the sequence inside the tensor-parallel "
                                  "group, so it needs tp > 1: try tp=2, or sp_mode='ring' with sp > 1")
            if self.sp != 1:
                raise ConfigError(f"sp_mode='split_gather' runs on the tp group and has no sp axis, so it "
                                  f"needs sp=1 (got sp={self.sp}): try sp=1 tp={self.tp * self.sp}, "
                                  "or sp_mode='ring'")

    def _check_experts(self) -> None:
        ep, fold = self.ep, self.dp * self.sp
        if fold % ep:
            ok = [k for k in range(1, fold + 1) if fold % k == 0]
            grow = f"dp={next(d for d in range(self.dp, self.dp * ep + 1) if d * self.sp % ep == 0)}"
            raise ConfigError(f"ep={ep} splits the experts over ranks that already split the batch (dp x sp = "
                              f"{self.dp} x {self.sp} = {fold}), so it must divide dp x sp: try ep={_or(ok)}, "
                              f"or {grow}, ep={ep}")

    def _check_pipeline(self) -> None:
        pp, m, v, s = self.pp, self.microbatches, self.chunks, self.schedule
        if s == "interleaved":
            if v < 2:
                raise ConfigError("schedule='interleaved' gives each pipeline rank several model chunks, "
                                  f"so it needs chunks > 1 (got chunks={v}): try chunks=2")
            if m % pp:
                ok = _nearest(m, lambda k: k % pp == 0)
                raise ConfigError(f"schedule='interleaved' needs microbatches divisible by pp={pp} "
                                  f"(got microbatches={m}): try microbatches={_or(ok)}")
        elif s == "zb-v":  # any microbatch count works: the list scheduler fills what the V leaves idle
            if v != 2:
                raise ConfigError(f"schedule='zb-v' places exactly two model chunks per pipeline rank, in a V "
                                  f"(stages 0..pp-1 down the ranks, pp..2pp-1 back up), so it needs chunks=2 "
                                  f"(got chunks={v}): set chunks=2" + (f", or schedule='interleaved' for {v} chunks"
                                                                        if v > 2 else ""))
        elif v != 1:
            also = " (or 'zb-v', which takes exactly 2)" if v == 2 else " ('zb-v' takes exactly 2)"
            raise ConfigError(f"chunks={v} (virtual stages) needs schedule='interleaved'{also}; "
                              f"schedule={s!r} runs one chunk per rank: set chunks=1 or schedule='interleaved'")


_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig))
"""ParallelConfig's fields, in order (``ParallelConfig.__new__`` names the nearest to an unknown keyword)."""
