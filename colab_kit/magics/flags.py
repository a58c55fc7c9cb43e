"""The ``%colossal`` flags and subcommands, declared once; argparse parsers that raise
``UsageError`` (never ``sys.exit``) and the help text built from the same table."""
from __future__ import annotations

import argparse

from IPython.core.error import UsageError

__all__ = ["FLAGS", "COMMANDS", "CELL_FLAGS", "parser", "help_text"]


def _rank_list(text: str) -> list[int]:
    try:
        return [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ranks like 0,2, got {text!r}") from None


FLAGS = {
    "n": (("-n",), dict(type=int, default=None, metavar="N", help="engines (ranks); default: one per GPU, else 4")),
    "engines": (("--engines",), dict(default="local", help="ipyparallel launcher: local, mpi, slurm, ssh, ...")),
    "timeout": (("--timeout",), dict(type=float, default=None, metavar="S", help="seconds before giving up")),
    "axis": (("--axis",), dict(default="tp", help="colour the ranks by their group on this axis")),
    "ranks": (("--ranks",), dict(type=_rank_list, default=None, metavar="0,2", help="only these ranks")),
    "pp": (("--pp",), dict(type=int, default=None, metavar="P", help="pipeline ranks")),
    "microbatches": (("-m", "--microbatches"), dict(type=int, default=None, metavar="M", help="microbatches per step")),
    "schedule": (("--schedule",), dict(default=None, metavar="S", help="gpipe, 1f1b, interleaved or zb-h1")),
    "chunks": (("--chunks",), dict(type=int, default=None, metavar="V", help="model chunks per rank (interleaved)")),
    "var": (("--var",), dict(default="engine", metavar="NAME", help="the engine's variable on the ranks")),
}
COMMANDS = {  # name: (flags, takes config words, help)
    "start": (("n", "engines", "timeout"), False, "start engines and torch.distributed; show the ranks"),
    "config": ((), True, "check a config (dp=2 tp=2 or --dp 2 --tp 2) and set it on every rank"),
    "mesh": (("axis",), True, "draw the device mesh of the config (or of config words given here)"),
    "schedule": (("pp", "microbatches", "schedule", "chunks"), False,
                 "plan a pipeline schedule (no cluster needed): grid, bubble, peak activations"),
    "timeline": (("var",), False, "the last training step of every rank: compute, communication, idle"),
    "status": ((), False, "show the cluster, its ranks and config"),
    "stop": ((), False, "stop the cluster"),
    "restart": ((), False, "fresh engines with the same config (after a failure)"),
    "help": ((), False, "this help"),
}
CELL_FLAGS = ("ranks", "timeout")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print and sys.exit: a clear UsageError instead
        raise UsageError(f"{self.prog}: {message}. Usage: {self.format_usage().strip()[7:]}")


def parser(prog: str, flags) -> _Parser:
    p = _Parser(prog=prog, add_help=False, allow_abbrev=False)
    for name in flags:
        names, kwargs = FLAGS[name]
        p.add_argument(*names, dest=name, **kwargs)
    return p


def help_text() -> str:
    lines = ["%colossal SUBCOMMAND [flags]:"]
    for name, (flags, words, text) in COMMANDS.items():
        usage = parser(f"%colossal {name}", flags).format_usage().strip()[7:] + (" [dp=.. tp=..]" if words else "")
        lines.append(f"  {usage:<58} {text}")
    lines.append("%%colossal [--ranks 0,2] [--timeout S]: run the cell on every rank (rank, config, mesh predefined)")
    return "\n".join(lines)
