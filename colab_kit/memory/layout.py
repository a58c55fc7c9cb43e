"""What one rank holds of a layout: parameters per part and per pipeline rank, one microbatch's saved bytes
on a stage, the most a pipeline rank holds at once. The pieces ``estimator.config_estimate`` (dense GPTs) and
``experts.moe_estimate`` (mixtures of experts) put together; neither imports the other's internals.

- ``part_params``: parameters per rank of the embeddings, one block, ``ln_f`` and the head, in each tensor
  mode, split the way the layers in ``colab_kit.tensor`` split them (1D: Megatron's column/row halves,
  vocabulary over tp; 2D/2.5D: q x q blocks, the token table V/q x h/q, the position table and every bias and
  LayerNorm h/q, the same on each 2.5D depth layer; 3D: the weights q**3 ways, the token table V/q^2 x h/q,
  biases, LayerNorms and positions q ways);
- ``stage_params`` / ``rank_params``: those parts summed over the stages each pipeline rank holds
  (``pipeline.stage.stage_layers`` and the schedule's placement, ``PipelinePlan.stages_of``);
- ``layout_activations``: one microbatch's saved bytes on one stage in the config's layout (tokens split over
  the tensor plan's batch axes and over sp; 2D/3D LayerNorms save their centred input and product, 3D Linears
  their gathered input and weight);
- ``pipeline_peak``: the most bytes a pipeline rank holds at once, walking its own actions in the schedule's
  order (``walks``: F adds a microbatch's stage bytes, B or W frees them), which is what the executor's meter
  counts; ``stage_plan``: the plan the engine runs, kept per schedule shape.
"""
from __future__ import annotations

import numpy as np

from .formulas import PRECISION_BYTES, activation_bytes
from .saves import BlockSaves
from ..pipeline.schedules import build_plan_for
from ..pipeline.stage import stage_layers

__all__ = ["layout_activations", "part_params", "pipeline_peak", "rank_params", "stage_params", "stage_plan", "walks"]


def part_params(model, config) -> dict:
    """Parameters one rank holds of each part of a ``ck.models.GPT`` (``model`` its GPTConfig)
    under ``config``'s tensor mode: ``{"embed", "block", "tail"}`` (tail = ln_f and head).

    >>> from colab_kit import ParallelConfig
    >>> from colab_kit.models import GPTConfig
    >>> g = GPTConfig(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2)
    >>> part_params(g, ParallelConfig())
    {'embed': 6144, 'block': 49984, 'tail': 4224}
    >>> part_params(g, ParallelConfig(tp=4, tp_mode="2d"))   # q = 2: blocks of 1/4, vectors of 1/2
    {'embed': 2048, 'block': 12704, 'tail': 1088}
    """
    h, f, v, t, tp = model.d_model, model.d_ff, model.vocab_size, model.seq_len, config.tp
    linears = ((h, 3 * h), (h, h), (h, f), (f, h))  # (in, out) of qkv, proj, fc1, fc2
    if tp == 1 or config.tp_mode == "1d":
        p = tp
        block = 4 * h + (3 * h * h + 3 * h) // p + (h * h) // p + h + (f * h + f) // p + (h * f) // p + h
        return {"embed": v // p * h + t * h, "block": block, "tail": 2 * h + v // p * h}
    q = config.tp_q
    if config.tp_mode in ("2d", "2.5d"):
        block = 4 * h // q + sum(i * o // (q * q) + o // q for i, o in linears)
        return {"embed": (v // q) * (h // q) + t * (h // q), "block": block, "tail": 2 * h // q + h * v // (q * q)}
    block = 4 * h // q + sum(i * o // q ** 3 + o // q for i, o in linears)  # 3d
    return {"embed": (v // (q * q)) * (h // q) + t * (h // q), "block": block, "tail": 2 * h // q + h * v // q ** 3}


# (schedule, pp, microbatches, chunks, model) -> PipelinePlan: ck.plan asks for each a few hundred times
_PLANS: dict = {}


def stage_plan(config, model=None):
    """The plan the engine runs for ``config`` and ``model`` (``build_plan_for``; read, never changed here:
    one per schedule shape and model, kept), and ``stage_layers``."""
    key = (config.schedule, config.pp, config.microbatches, config.chunks,
           repr(model) if config.schedule == "zb-v" else None)  # only zb-v's plan reads the model (its FLOPs)
    if key not in _PLANS:
        if len(_PLANS) > 512:
            _PLANS.clear()
        _PLANS[key] = build_plan_for(config, model)
    return _PLANS[key], stage_layers


def stage_params(model, config) -> list[int]:
    """Parameters per pipeline rank (before ZeRO), for each of the ``pp`` ranks.

    >>> from colab_kit import ParallelConfig
    >>> from colab_kit.models import GPTConfig
    >>> stage_params(GPTConfig(n_layers=4), ParallelConfig(pp=2))   # embeddings + 2 blocks | 2 blocks + head
    [106112, 104192]
    """
    parts = part_params(model, config)
    if config.pp == 1:
        return [parts["embed"] + model.n_layers * parts["block"] + parts["tail"]]
    plan, stage_layers = stage_plan(config)  # the stages each rank holds: the placement, whatever the plan's fit
    return [blocks * parts["block"] + parts["embed"] * first + parts["tail"] * last
            for blocks, first, last in _rank_stages(plan, model.n_layers, stage_layers)]


_RANK_STAGES: dict = {}


def _rank_stages(plan, n_layers: int, stage_layers) -> list[tuple[int, int, int]]:
    """For each pipeline rank of ``plan``: the blocks of its stages, and whether it holds the first stage (the
    embeddings) and the last (ln_f and the head), what ``stage_params`` multiplies out. Kept per plan (by
    identity, the plan held so that its id is not reused, as ``walks``) and ``n_layers``: ``plan.stages_of``
    scans every stage for each rank (9,216 ``rank_of`` calls for pp=96), and the planner asks for thousands
    of estimates of a few hundred plans."""
    key = (id(plan), n_layers)
    if key not in _RANK_STAGES or _RANK_STAGES[key][0] is not plan:
        if len(_RANK_STAGES) > 512:
            _RANK_STAGES.clear()
        n = plan.pp * plan.chunks
        layers = stage_layers(n_layers, n)
        per_rank = [plan.stages_of(r) for r in range(plan.pp)]
        _RANK_STAGES[key] = (plan, [(sum(len(layers[s]) for s in stages), int(0 in stages), int(n - 1 in stages))
                                    for stages in per_rank])
    return _RANK_STAGES[key][1]


def rank_params(model, config, pp_rank: int | None = None) -> int:
    """Parameters on one rank (pipeline rank ``pp_rank``; None: the fullest)."""
    per = stage_params(model, config)
    return max(per) if pp_rank is None else per[pp_rank]


def layout_activations(model, config, rows: int, seq: int, *, layers: int, first: bool = True,
                       last: bool = True, saves: BlockSaves | None = None) -> int:
    """Bytes saved for backward by one microbatch of ``rows`` dp-local sequences of ``seq`` tokens
    on one stage (``layers`` blocks; ``first``/``last``: embeddings / head and loss there).

    1D, split_gather and no tensor parallelism: ``memory.activation_bytes`` (sp splits the tokens:
    ``seq / sp`` per rank). 2D/2.5D: this rank's rows ``rows / (d q)``, features ``h / q``, heads,
    MLP and vocabulary ``/ q``; each LayerNorm2D saves its centred input, the product before the
    weight and 1/std (``2 e N h + e N``). 3D: rows ``/ q^2``, features ``/ q``, and each Linear3D
    keeps its all-gathered input (q times its piece) and its gathered weight (``W^``, out/q x in/q).
    ``saves``: the block's architecture (``memory.saves``; the GPT's when None); 2D and 3D count the GPT's
    LayerNorms and Linears at the architecture's attention and MLP widths.
    """
    saves = saves or BlockSaves.of_gpt(model)
    e = PRECISION_BYTES[config.precision]
    seq = seq // config.sp if config.sp_mode != "split_gather" else seq
    recompute = config.recompute
    if recompute == "selective" and config.sp > 1 and config.sp_mode == "ring":
        recompute = "none"  # the ring's backward already rebuilds its blocks: selective changes nothing there
    ring = config.sp > 1 and config.sp_mode == "ring"
    if config.tp == 1 or config.tp_mode == "1d":
        split = config.tp if config.sp_mode == "split_gather" and config.tp > 1 else 1
        held = activation_bytes(model, rows, seq=seq, layers=layers, first=first, last=last, tp=config.tp,
                                recompute=recompute, bytes_per_elem=e, sequence_split=split, saves=saves)["held"]
        if recompute == "op" and ring:  # the ring's kernels run in its autograd Function: its output is recomputed
            held -= layers * saves.kernel(rows * seq, e, config.tp)
        if config.sp > 1 and config.sp_mode != "split_gather" and recompute in ("none", "selective"):
            n = rows * seq  # under sp: k, v repeated to the q heads, the output copied back (fp32 from the ring)
            held += layers * saves.sp_copies(n, e, config.tp, output=recompute == "none")
            held += layers * saves.ring_fp32(n, e, config.tp) if ring else 0
        return held
    q, h, f, a, v = config.tp_q, model.d_model, model.d_ff, model.n_heads, model.vocab_size
    qw, kvw, mlp = saves.q, saves.kv, saves.inner * saves.ffn  # the MLP's saved inner widths
    shards = config.tp_depth * q if config.tp_mode != "3d" else q * q
    n = rows // shards * seq
    hl, fl, al, vl = h // q, f // q, a // q, v // q
    # RMSNorm2D/3D: an fp32 copy, 1/rms (fp32), the normed; LayerNorm2D/3D: centred, product, 1/std
    ln = (4 * n * hl + e * n * hl + 4 * n) if saves.norm == "rms" else 2 * e * n * hl + e * n
    attn = (e * n * (2 * qw + 2 * kvw) + saves.qk_bytes(n, e)) // q + 4 * n * al
    if config.tp_mode == "3d":
        gathered = e * q * n * (2 * hl + hl + fl)  # X^ of qkv, fc1 (residual), proj (inner), fc2 (MLP inner)
        weights = e * (3 * h * h + h * h + 2 * h * f) // (q * q)
        inner = (saves.inner - saves.act_saves) * saves.ffn // 2 + saves.act_saves * saves.ffn  # fc2's input: above
        block = 2 * ln + gathered + weights + attn + e * n * inner // q
        head = ln + e * q * n * hl + e * h * v // (q * q) + 4 * n * (v // q) + 8 * n + 4
        embed = 8 * n * q + 8 * seq
    else:
        block = 2 * ln + 2 * e * n * hl + attn + e * n * mlp // q
        head = ln + e * n * hl + 4 * n * vl + 8 * n + 4
        embed = 8 * n * q + 8 * seq  # VocabEmbedding2D gathers the ids of the grid column
    kept = {"full": e * n * hl, "selective": block - 4 * n * al, "none": block}  # core: its lse
    if config.tp_mode == "3d":  # "op" (1d, 3d only): input, qkv's and fc1's matmul outputs (q n rows), the kernel's
        kept["op"] = e * n * hl + e * q * n * (3 * hl + fl) + (0 if ring else e * n * hl + 4 * n * al)
    kept = kept[recompute]
    rope = saves.rope(seq, e) if layers and recompute in ("none", "selective") else 0  # recomputed under op, full
    return layers * kept + (embed if first else 0) + (head if last else 0) + rope


def pipeline_peak(model, config, rows: int, seq: int, *, fitted: bool = True,
                  saves: BlockSaves | None = None) -> list[int]:
    """Most activation bytes each pipeline rank holds at once in one step, ``rows`` dp-local
    sequences per microbatch: the rank's compute actions in order, F adding its stage's bytes
    (``layout_activations``), B or W (zero-bubble: after I the weight pass still reads them)
    freeing them. GPipe holds every microbatch; 1F1B at most ``pp - rank``. ``fitted=False`` walks zb-v's
    plan at unit costs instead of the one fitted to the model's FLOPs (the planner's, for deep pipelines)."""
    plan, stage_layers = stage_plan(config, model if fitted else None)
    n = config.pp * config.chunks
    layers = stage_layers(model.n_layers, n)
    # the stages' bytes differ only by their blocks, the first and the last: each asked once (n up to 192)
    acts, stores = {}, {}
    per, store = [], []
    for s in range(n):
        key = (len(layers[s]), s == 0, s == n - 1)
        if key not in acts:
            acts[key] = layout_activations(model, config, rows, seq, layers=key[0], first=key[1], last=key[2],
                                           saves=saves)
            stores[key] = _weight_store(model, config, rows, seq, key[0], key[2], saves)
        per.append(acts[key])
        store.append(stores[key])
    peaks = []
    for stages, counts in walks(plan):
        values = np.array([per[s] for s in stages] + [store[s] for s in stages], dtype=np.int64)
        peaks.append(int((counts @ values).max()))
    return peaks


_WALKS: dict = {}


def walks(plan) -> list[tuple[list[int], np.ndarray]]:
    """Each rank's walk through its compute actions in order, as counts: row t says how many of each of
    its stages' activations (``per``) and weight stores (``store``) are held after its t-th action (a first
    row of zeros: the peak is at least 0). F adds its stage's activations; B, or W after I, frees them
    (stage 0's I defers its whole backward to W; a later stage's I trades them for the store). The bytes
    held at t are then ``counts[t] @ (per + store)`` for any model and layout: one walk per plan, kept."""
    key = id(plan)
    if key not in _WALKS or _WALKS[key][0] is not plan:
        if len(_WALKS) > 512:
            _WALKS.clear()
        out = []
        for r in range(plan.pp):
            stages = plan.stages_of(r)
            col = {s: j for j, s in enumerate(stages)}
            k = len(stages)
            rows, now = [[0] * (2 * k)], [0] * (2 * k)
            for act in plan.compute(r):
                j = col[act.stage]
                if act.kind == "F":
                    now[j] += 1
                elif act.kind in ("B", "W"):
                    now[k + j if act.kind == "W" and act.stage > 0 else j] -= 1
                elif act.kind == "I" and act.stage > 0:
                    now[k + j] += 1
                    now[j] -= 1
                rows.append(list(now))
            out.append((stages, np.unique(np.array(rows, dtype=np.int64), axis=0)))
        _WALKS[key] = (plan, out)
    return _WALKS[key][1]


def _weight_store(model, config, rows: int, seq: int, layers: int, last: bool,
                  saves: BlockSaves | None = None) -> int:
    """What a zero-bubble I leaves for its W (``tensor.zero_bubble.WeightGradStore``): each Linear's input
    and output gradient, 1D layout (``BlockSaves.store``; a GPT block's inputs qkv h, proj h/tp, fc1 h, fc2 f/tp,
    its gradients (q + 2 kv)/tp, h, f/tp, h; the head h and its output gradient V/tp). The executor's peak
    counts a store from its I (it counted it only at the next F, so a store larger than what the forward saved,
    as under recomputation, went unseen: the GPT of tests/ranks/test_recompute.py under zb-h1, pp=2, m=4, full
    recomputation, measured 168,484 B on its last stage, where two stores of 143,360 B are held at once)."""
    if config.tp > 1 and config.tp_mode != "1d":  # 2D, 2.5D and 3D layers are not split: their W runs in I
        return 0
    n = rows * (seq // config.sp)
    return (saves or BlockSaves.of_gpt(model)).store(n, PRECISION_BYTES[config.precision], config.tp, layers, last)
