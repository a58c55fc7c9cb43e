"""Pipeline parallelism: schedules as data, lowered with communication, run by one executor."""
from .actions import Action, format_actions, parse, stage_rank
from .check import PlanError, check, steps
from .lowering import lower, message_tag, peer
from .schedules import Plan, build_plan, build_plan_for
from .simulate import Timeline, simulate
from .executor import PipelineExecutor
from .hang import PipelineHang
from .stage import Stage, split_model

__all__ = ["Action", "parse", "format_actions", "stage_rank"]
__all__ += ["Plan", "build_plan", "build_plan_for", "lower", "peer", "message_tag", "check", "steps",
            "PlanError", "simulate", "Timeline"]
__all__ += ["PipelineExecutor", "PipelineHang", "Stage", "split_model"]
