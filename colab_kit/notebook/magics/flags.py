"""The ``%colossal`` flags and subcommands, declared once: the argparse parsers (which raise
``UsageError``, never ``sys.exit``), each subcommand's ``-h`` and the help text that
``%colossal``, ``%colossal?`` and ``%colossal help`` show are all built from this table."""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import shlex
from typing import Any

from IPython.core.error import UsageError

from ...config import Axis, ParallelConfig

__all__ = ["FLAGS", "COMMANDS", "CELL_FLAGS", "CELL_HELP", "CONFIG_WORDS", "parser", "command_parser", "cell_parser",
           "split", "wants_help", "help_text"]

HELP = ("-h", "--help")
CONFIG_WORDS = "[dp=2 tp=2 ... | --dp 2 --tp 2 ...]"


def _positive_int(text: str) -> int:
    value = int(text)  # a ValueError reads "invalid int value: 'four'"
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive whole number, got {text!r}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def _rank_list(text: str) -> list[int]:
    try:
        ranks = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        ranks = None
    if not ranks:
        raise argparse.ArgumentTypeError(f"expected comma-separated ranks like 0,2, got {text!r}")
    if min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"ranks are numbered from 0, got {text!r}")
    return ranks


def _host_list(text: str) -> dict[str, int]:
    """``10.0.0.1:2,10.0.0.2:2`` -> {"10.0.0.1": 2, "10.0.0.2": 2} (engines per host, in that order)."""
    hosts: dict[str, int] = {}
    for word in (w.strip() for w in text.split(",") if w.strip()):
        host, _, count = word.rpartition(":")
        if not host or not count.isdigit() or int(count) < 1 or host in hosts:
            raise argparse.ArgumentTypeError(f"expected host:engines pairs like 10.0.0.1:2,10.0.0.2:2 (each host "
                                             f"once, at least one engine), got {text!r}")
        hosts[host] = int(count)
    if not hosts:
        raise argparse.ArgumentTypeError(f"expected host:engines pairs like 10.0.0.1:2,10.0.0.2:2, got {text!r}")
    return hosts


_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _bytes(text: str) -> int:
    """``64MiB``, ``1.5GiB``, ``4096`` (bytes): binary units only, so 64MiB is exactly 64 * 2**20."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m and (m.group(2).lower() or "b")
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected bytes like 64MiB, 1.5GiB or 4096 (units B, KiB, MiB, GiB, TiB), "
                                         f"got {text!r}")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte, got {text!r}")
    return value


def _word(text: str) -> str:
    """A name from a fixed set (a schedule, an axis, category|place), in any case: ``1F1B``, ``ZB-H1`` and ``DP``
    read as ``%colossal config`` reads them (lower-cased), then are checked against the set."""
    return text.strip().lower()


# argparse names the type in its message
_positive_int.__name__, _seconds.__name__, _bytes.__name__, _host_list.__name__ = "int", "float", "bytes", "hosts"
_word.__name__ = "name"

FLAGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "n": (("-n",), dict(type=_positive_int, default=None, metavar="N",
                        help="engines (ranks); default: one per GPU, else 4")),
    "fit": (("--fit",), dict(action="store_true",
                             help="start fewer than -n where memory is short (Binder's 2 GiB): the largest of "
                                  "n, n/2, ... that fits, saying why")),
    "engines": (("--engines",), dict(default="local", help="ipyparallel launcher: local, mpi, slurm, ssh, ...")),
    "ip": (("--ip",), dict(default=None, metavar="ADDR",
                           help="address the controller listens on, reachable from every host (not for local)")),
    "hosts": (("--hosts",), dict(type=_host_list, default=None, metavar="A:2,B:2",
                                 help="engines per host for --engines ssh; -n defaults to their sum")),
    "profile": (("--profile",), dict(default=None, metavar="NAME|DIR",
                                     help="ipyparallel profile (a name, or a directory) whose ipcluster_config.py "
                                          "configures the launcher: ssh options, Slurm account, ...")),
    "timeout": (("--timeout",), dict(type=_seconds, default=None, metavar="S", help="seconds before giving up")),
    "axis": (("--axis",), dict(type=_word, default=Axis.TP,
                               help="colour the ranks by their group on this axis, any case (experts: the dense, ep "
                                    "and edp groups side by side)")),
    "ranks": (("--ranks",), dict(type=_rank_list, default=None, metavar="0,2", help="only these ranks")),
    "pp": (("--pp",), dict(type=int, default=None, metavar="P", help="pipeline ranks")),
    "microbatches": (("-m", "--microbatches"), dict(type=int, default=None, metavar="M", help="microbatches per step")),
    "schedule": (("--schedule",), dict(type=_word, default=None, metavar="S",
                                       help="gpipe, 1f1b, interleaved, zb-h1 or zb-v (any case)")),
    "chunks": (("--chunks",), dict(type=int, default=None, metavar="V",
                                   help="model chunks per rank (interleaved; zb-v takes 2)")),
    "var": (("--var",), dict(default="engine", metavar="NAME", help="the engine's variable on the ranks")),
    "data": (("--data",), dict(default="batch", metavar="NAME",
                               help="the batch's variable on the ranks (a batch, or a function step -> batch)")),
    "by": (("--by",), dict(type=_word, default="category", choices=("category", "place"), metavar="category|place",
                           help="stack the bars by category (params, grads, ...) or by place (device, host)")),
    "timeline": (("--timeline",), dict(action="store_true",
                                       help="one step of --var on --data sampled after every op: bytes by category "
                                            "over the step, the peak and what was alive at it")),
    "layer": (("--layer",), dict(type=int, default=None, metavar="L",
                                 help="the MoE layer whose load to show (default: every MoE layer stacked)")),
    "model": (("--model",), dict(required=True, metavar="VAR", help="a GPTConfig (or GPT) in a kernel variable")),
    "batch": (("--batch",), dict(type=_positive_int, required=True, metavar="N",
                                 help="global batch (sequences per step)")),
    "world": (("--ranks",), dict(type=_positive_int, default=None, metavar="N",
                                 help="ranks to plan for; default: the cluster's size")),
    "memory": (("--memory",), dict(type=_bytes, default=None, metavar="64MiB",
                                   help="memory per rank (B, KiB, MiB, GiB); candidates over it are marked")),
    "top": (("--top",), dict(type=_positive_int, default=10, metavar="K", help="show the best K candidates")),
    "path": (("path",), dict(metavar="PATH", help="where to write the script: a .py path (train: train.py; another "
                                                  "suffix is refused), or an existing folder (train.py in it); a "
                                                  "Slurm batch file (.sbatch) is written beside it")),
}
COMMANDS = {  # name: (flags, takes config words, help)
    "start": (("n", "fit", "engines", "ip", "hosts", "profile", "timeout"), False,
              "start engines and torch.distributed; show the ranks"),
    "config": ((), True, "check a config (dp=2 tp=2 or --dp 2 --tp 2) and set it on every rank"),
    "mesh": (("axis",), True, "draw the device mesh of the config (or of config words given here)"),
    "schedule": (("pp", "microbatches", "schedule", "chunks"), False,
                 "plan a pipeline schedule (no cluster needed): grid, bubble, peak activations"),
    "timeline": (("var",), False, "the last training step of every rank: compute, communication, idle"),
    "profile": (("var", "data"), False,
                "profile one step on every rank: compute, communication by axis, idle, overlap"),
    "memory": (("var", "by", "timeline", "data"), False,
               "memory per rank beside the estimate; --timeline: over one step, op by op"),
    "moe": (("var", "layer"), False,
            "experts: load per step and all-to-all traffic (recorded)"),
    "plan": (("model", "batch", "world", "memory", "top"), False,
             "plan a model's configs: estimated memory and step time; Apply one"),
    "export": (("path",), False, "write the configs and cells the cluster ran as a script for torchrun or srun"),
    "status": ((), False, "show the cluster, its ranks and config"),
    "stop": ((), False, "stop the cluster"),
    "restart": ((), False, "fresh engines with the same config (after a failure)"),
    "help": ((), False, "this help (help SUBCOMMAND: that subcommand's)"),
}
CELL_FLAGS = ("ranks", "timeout")
CELL_HELP = "run the cell on every rank (or on --ranks); rank, config and mesh are predefined there"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print and sys.exit: a clear UsageError instead
        raise UsageError(f"{self.prog}: {message}. Usage: {self.usage_line()}")

    def usage_line(self) -> str:
        return " ".join(self.format_usage().split())[len("usage: "):]  # one line, however argparse wrapped it


def parser(prog: str, flags, help: str = "", words: bool = False) -> _Parser:
    """The parser of one subcommand; ``-h`` is accepted (see ``wants_help``) but not listed in usage lines."""
    keys = ", ".join(f.name for f in dataclasses.fields(ParallelConfig))
    p = _Parser(prog=prog, add_help=False, allow_abbrev=False, description=help,
                epilog=f"config words: key=value or --key value, keys: {keys}" if words else None)
    p.add_argument(*HELP, action="store_true", dest="help", help=argparse.SUPPRESS)
    for name in flags:
        names, kwargs = FLAGS[name]
        if names[0].startswith("-"):
            p.add_argument(*names, dest=name, **kwargs)
        else:  # a positional argument (argparse names it itself)
            p.add_argument(name, **kwargs)
    if words:
        p.usage = f"{p.usage_line()} {CONFIG_WORDS}".replace("%", "%%")  # argparse %-formats usage
    return p


def command_parser(name: str) -> _Parser:
    flags, words, text = COMMANDS[name]
    return parser(f"%colossal {name}", flags, text, words)


def cell_parser() -> _Parser:
    return parser("%%colossal", CELL_FLAGS, CELL_HELP)


def split(line: str, prog: str) -> list[str]:
    """``shlex.split``, with an unbalanced quote (``--ranks '0,``) a UsageError."""
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"{prog}: cannot split {line!r} into words: {exc}") from None


def wants_help(argv: list[str]) -> bool:
    return any(word in HELP for word in argv)


def _flag_lines(flags) -> list[str]:
    """One line per flag as argparse would show it: ``--fit`` (a switch takes no value), ``--engines ENGINES``,
    ``-m, --microbatches M``, and a positional argument as its placeholder alone (``PATH``)."""
    lines = []
    for name in flags:
        names, kwargs = FLAGS[name]
        if not names[0].startswith("-"):  # positional: argparse shows its metavar (or its name upper-cased)
            label = kwargs.get("metavar", names[0].upper())
        elif kwargs.get("action") in ("store_true", "store_false", "count"):
            label = ", ".join(names)
        else:
            label = ", ".join(names) + f" {kwargs.get('metavar', name.upper())}"
        lines.append(f"      {label:<22} {kwargs['help']}")
    return lines


def help_text() -> str:
    """Every subcommand with its flags, then the cell magic (``%colossal?`` shows this too)."""
    lines = ["%colossal SUBCOMMAND [flags]   (-h after any subcommand: its help)", ""]
    for name, (flags, _words, text) in COMMANDS.items():
        lines += [f"  {command_parser(name).usage_line()}", f"      {text}", *_flag_lines(flags)]
    lines += ["", cell_parser().usage_line(), f"      {CELL_HELP}",
              *_flag_lines(CELL_FLAGS)]
    return "\n".join(lines)
