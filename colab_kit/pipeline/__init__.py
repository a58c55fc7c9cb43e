"""Pipeline parallelism: schedules as data, lowered with communication, run by one executor.

    actions.py     Action: one step of one stage (F, B, I, W and the messages SF/RF/SB/RB)
    plan.py        PipelinePlan: a step's actions per rank; where each stage runs
    schedules.py   build_plan: GPipe, 1F1B, interleaved, ZB-H1, ZB-V write a PipelinePlan
    costs.py       stage costs from FLOPs or measurements; the list-scheduled ZB-V
    lowering.py    lower: add each message's send and receive
    check.py       check: a plan is free of deadlock, or PlanError says where it waits
    simulate.py    simulate: a plan's timeline under costs
    stage.py       split_model: a model's layers into stages
    compute.py     what F, B, I and W do on a stage (the executor's compute)
    messages.py    what SF/RF/SB/RB do (point-to-point between stages)
    executor.py    PipelineExecutor: runs a plan on this rank
    work.py        MicrobatchWork: what the step loop hands the executor for one step
    (the I/W split of a linear's backward that ZB schedules use: colab_kit.tensor.zero_bubble)
    hang.py        PipelineHang: which rank waits on which message, when a step stalls
"""
from .actions import Action, format_actions, parse
from .plan import PLACEMENTS, SCHEDULE_PLACEMENT, PipelinePlan, stage_rank
from .check import PlanError, check, steps
from .lowering import lower, message_tag, peer
from .schedules import build_plan, build_plan_for
from .simulate import Timeline, simulate
from .executor import PipelineExecutor
from .hang import PipelineHang
from .stage import Stage, split_model

__all__ = ["Action", "parse", "format_actions", "stage_rank"]
__all__ += ["PipelinePlan", "PLACEMENTS", "SCHEDULE_PLACEMENT", "build_plan", "build_plan_for", "lower", "peer",
            "message_tag", "check", "steps", "PlanError", "simulate", "Timeline"]
__all__ += ["PipelineExecutor", "PipelineHang", "Stage", "split_model"]
