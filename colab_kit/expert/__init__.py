"""Expert parallelism (``ParallelConfig(ep=)``): the experts of each MoE layer split over ep ranks folded over
dp x sp, tokens dispatched and combined by all-to-all (``layer``), the step of ``ck.parallelize`` (``apply``).
``docs/moe.md`` tells the whole story."""
from .apply import apply_expert_parallel, expert_modules
from .layer import AllToAll, ExpertParallel, expert_major

__all__ = ["apply_expert_parallel", "expert_modules", "AllToAll", "ExpertParallel", "expert_major"]
