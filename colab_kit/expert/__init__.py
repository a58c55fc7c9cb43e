"""Expert parallelism (``ParallelConfig(ep=)``): the experts of each MoE layer split over ep ranks folded over
dp x sp, tokens dispatched and combined by all-to-all (``layer``; Hugging Face's fused experts: ``hf``), the step of
``ck.parallelize`` (``apply``).
``docs/moe.md`` tells the whole story."""
from .apply import apply_expert_parallel, expert_count, expert_modules
from .hf import HFExpertParallel
from .layer import AllToAll, ExpertParallel, expert_major

__all__ = ["apply_expert_parallel", "expert_modules", "expert_count", "AllToAll", "ExpertParallel",
           "HFExpertParallel", "expert_major"]
