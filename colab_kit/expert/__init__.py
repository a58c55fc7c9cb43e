"""Expert parallelism (``ParallelConfig(ep=)``): the experts of each MoE layer split over ep ranks folded over
dp x sp, tokens dispatched and combined by all-to-all (``layer``; Hugging Face's fused experts: ``hf``), the step of
``ck.parallelize`` (``apply``), the part's declaration with its rules and hooks (``part``), what a training step
does for MoE layers per microbatch (``step``: ``ExpertSteps``, a mixin of the engine's ``TrainingStep``) and what
it records of them (``records``: ``engine.records[i]["moe"]``, the traffic matrix). ``docs/moe.md`` tells the
whole story."""
from .apply import apply_expert_parallel, expert_count, expert_modules
from .hf import HFExpertParallel
from .layer import AllToAll, ExpertParallel, expert_major

__all__ = ["apply_expert_parallel", "expert_modules", "expert_count", "AllToAll", "ExpertParallel",
           "HFExpertParallel", "expert_major"]
