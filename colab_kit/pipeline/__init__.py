"""Pipeline parallelism: schedules as data, lowered with communication, run by one executor."""
from .actions import Action, format_actions, parse, stage_rank

__all__ = ["Action", "parse", "format_actions", "stage_rank"]
