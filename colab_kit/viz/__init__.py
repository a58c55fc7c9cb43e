"""Pure plotly figure builders: data in, ``go.Figure`` out (no widgets, no processes).

Figures of recorded data say so in their title; planned or analytic data is
labelled as planned.
"""
from .memory import memory_by_rank_figure
from .mesh import expert_mesh_figure, mesh_figure
from .moe import expert_load_figure, moe_traffic_figure
from .planner import plan_figure, plan_vs_measured_figure, tp_scaling_figure
from .pipeline import activation_memory_figure, activation_peaks_figure, bubble_figure, schedule_figure
from .sequence import longest_fit, ring_figure, sequence_memory_figure, ulysses_figure, zigzag_figure
from .tensor import traffic_figure, weight_owner_figure
from .training import accuracy_figure, loss_figure, memory_figure, recipe_figure, timeline_figure

__all__ = ["mesh_figure", "expert_mesh_figure", "expert_load_figure", "moe_traffic_figure",
           "accuracy_figure", "loss_figure", "recipe_figure", "memory_figure", "memory_by_rank_figure",
           "timeline_figure", "weight_owner_figure", "traffic_figure", "schedule_figure", "activation_memory_figure",
           "bubble_figure", "activation_peaks_figure", "zigzag_figure", "ring_figure", "ulysses_figure",
           "sequence_memory_figure", "longest_fit", "plan_figure", "plan_vs_measured_figure", "tp_scaling_figure"]
