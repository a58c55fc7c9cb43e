"""What the notebook tier checks, shared by its three files (nbclient, the browser, Binder/Colab): the
notebooks, the outputs each must show (``EXPECT``; ``ASKED`` per cluster size), and whether the browser
tier can run here."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHROMIUM = "/usr/bin/chromium"
BINDER_RUNS = "01_quickstart.ipynb"
"""The notebook tests/notebooks/test_colab_binder.py runs in binder/'s environment where the browser tier cannot
(where it can, the browser tier runs every notebook there): tests/notebooks/test_notebooks.py leaves it to them."""

EXPECT = {  # notebook -> [(marker in the cell source, text its output must contain)]
    "01_quickstart.ipynb": [
        ("%colossal start -n 4", "started 4 ranks"),
        ("%colossal config dp=4", "config set on 4 ranks: dp=4 = 4 ranks"),
        ("engine.train_step", "[ranks 0, 1, 2, 3]\nstep  0  loss"),
        ("engine.train_step", "step 59  loss"),
        ("engine.train_step", "unigram entropy of the text"),
        ("engine.train_step", "engine: steps 1-60 · loss "),
        ("engine.train_step", "(under the clip at 1)"),
        ("engine.train_step", "MFU"),
        ("viz.recipe_figure", "steps clipped: "),
        ("engine.generate", "loaded step 60; sample: 'def "),
        ("engine.memory()", "rank 3: params"),
        ('raise RuntimeError("rank 2', "[rank 2] FAILED"),
        ('raise RuntimeError("rank 2', "RankError: rank 2 failed in %%colossal"),
        ('raise RuntimeError("rank 2', "%colossal restart"),
        ("%colossal status", "NEEDS RESTART"),
        ("sum of ranks", "sum of ranks = 6, config dp=4 = 4 ranks"),
        ("%colossal stop", "cluster stopped"),
    ],
    "02_tensor_parallel.ipynb": [
        ("%colossal start -n 8 --fit", "ranks (local engines, nccl_rules)"),
        ('assert r["forward"] == f["forward"]', "| wire sent"),
        ("dense_bytes", "(2d) = "),
        ('explore("tp=6', "refused before any rank ran: tp=6 with tp_mode='2d' needs tp to be a square"),
        ("largest relative difference", "ranks vs one process"),
    ],
    "03_pipeline.ipynb": [
        ('print(build_plan("1f1b"', "rank 3: 3F0 3B0 3F1 3B1"),
        ("--schedule gpipe", "bubble 27.3% of rank time (textbook (p-1)/(m+p-1) = 27.3%)"),
        ("--schedule gpipe", "peak activations held per rank: 8, 8, 8, 8"),
        ("--schedule 1f1b", "peak activations held per rank: 4, 3, 2, 1"),
        ("--schedule interleaved --chunks 2", "this schedule's (p-1)/(v*m+p-1) = 15.8%"),
        ("--schedule zb-h1", "bubble 11.1% of rank time"),
        ("planned = {s: simulate", "zb-h1        planned bubble  11.1%"),
        ("%colossal start -n 4", "started 4 ranks"),
        ("cluster.run(measure", "schedule      planned  measured   peak activation MiB per rank (measured)"),
        ("cluster.run(measure", "interleaved     15.8%"),
        ("engine = ck.boost", "rank 3: stage 3 of 4: blocks 3-3, ln_f, head"),
        ("stepper.step(9)", "engine on 4 ranks: step 1, timestep 9 of 60"),
        ("stepper.step(9)", "pp rank 0 (rank 0): ran 8 of 32 actions, next 0RB0, holds 4 activations"),
        ("stepper.play()", "step 1, finished"),
        ("stepper.play()", "loss of step 1: "),
        ("%colossal timeline", "last step of 'engine' on 4 ranks (measured"),
        ("%colossal timeline", "pipeline bubble (measured):"),
        ("largest relative difference", "pipeline (pp=4, 1f1b) vs one process"),
        ("%colossal stop", "cluster stopped"),
    ],
    "04_zero_and_memory.ipynb": [
        ("for precision in", "zero=3 fp32         0.82     0.82       1.65          3.29"),
        ("%colossal start -n 4", "started 4 ranks"),
        ("runs = {name: cluster.run", "zero=3 bf16 recompute"),
        ("reference = {p: one_process", "zero=3 offload=cpu       losses"),
        ("reference = {p: one_process", "vs one process (bf16)"),
        ("len(engine.data_parallel.chunks)", "rank 3: loss"),
        ("%colossal memory --by place", "device budget: 7,837,286 B"),
        ("device_budget=BUDGET", "-> host    793,092 B of states do not fit"),
        ("device_budget=BUDGET", "rank 3: device account peak"),
        ("deep = cluster.run", "under the budget vs one process"),
        ("%colossal stop", "cluster stopped"),
    ],
    "05_sequence_parallel.ipynb": [
        ("saved_bytes(plain, t)", " 1024                     33.00      0.281"),
        ("%colossal start -n 4", "started 4 ranks"),
        ("ring = cluster.run", "f0 f1 f2 f3 f0 f1 f2 f3 b0 b1 b2 b3 b0 b1 b2 b3"),
        ("ring = cluster.run", "rotation 1: rank 0 holds [3, 4]   rank 1 holds [0, 7]"),
        ("uly = cluster.run", "rank 0 recorded 8 all_to_all over sp in the last step"),
        ("uly = cluster.run", "derived from the layout, per block: q, k, v to heads 24,576 B, output to tokens 8,192 B"),
        ("BUDGET = 2 * MiB", "activations per rank, MiB (budget 2.00 MiB)"),
        ("BUDGET = 2 * MiB", "split_gather tp=4"),
        ("fits = viz.longest_fit", "ring sp=4            768"),
        ("fits = viz.longest_fit", "one process          192"),
        ("largest relative difference", "ulysses sp=4  sgd"),
        ("%colossal stop", "cluster stopped"),
    ],
    "06_hybrid_and_planner.ipynb": [
        ("cands = ck.plan(MODEL, RANKS", "fit under 2 MiB per rank"),
        ("%colossal start -n $RANKS", "ranks (local engines, nccl_rules)"),
        ("%colossal plan --model MODEL", "best first (planned: estimated, not run); memory per rank 2.00 MiB"),
        ("measured = [cluster.run(trial", "planned (estimated) / measured on the"),
        ("before = cluster.run(first_part", "tp=2 pp=2 microbatches=2: losses"),
        ("view.select(best)", "config set on "),
        ("after = cluster.run(resume", "at step 3: losses"),
        ("largest relative difference", "vs one process: "),
        ("%colossal stop", "cluster stopped"),
    ],
    "07_bring_your_own_model.ipynb": [
        ("policy = policy_for(ViT(VIT))", "patch                  input"),
        ("%colossal start -n 8 --fit", "ranks (local engines, nccl_rules)"),
        ("vit = {words: cluster.run", "tp=4 tp_mode=2d"),
        ("x, y, order = digit_data()", "steps 1-20 within"),
        ("bert, rotations = cluster.run", "sp=4 ring (4 rotations of K/V per pass)"),
        ("gpt2 = cluster.run", "tp=2 pp=2 schedule=zb-v chunks=2 microbatches=2"),
        ("class Mixer", "without a policy: tp=2 needs a sharding policy for Net"),
        ("net = cluster.run", "tp=2 pp=2 microbatches=2: largest relative difference"),
        ("%colossal stop", "cluster stopped"),
    ],
    "08_where_the_time_goes.ipynb": [
        ("%colossal start -n 4", "started 4 ranks"),
        ("runs = {name: cluster.run(profiled", "dp=4 zero=3"),
        ("runs = {name: cluster.run(profiled", "ZeRO all_gather"),
        ("reference.append(loss.item())", "pp=4 1f1b m=4    losses"),
        ("reference.append(loss.item())", "largest relative difference vs one process"),
        ("%colossal profile", "one profiled step of 'engine' on 4 ranks (measured with torch.profiler)"),
        ("overlap_row(f\"dp=4, buckets", "dp=4, buckets of 4,096 B"),
        ("overlap_row(f\"dp=4, buckets", "dp=4 zero=3, prefetch=False"),
        ("%colossal memory --timeline", "memory over one step of 'engine' on 4 ranks (measured after every op)"),
        ("%colossal memory --timeline", "gradient storage (a bucket)"),
        ("(the timeline's peak)", "rank 3: engine.memory() step_peak"),
        ("roofs = {name", "communication-bound"),
        ("report = dry_run(", "dry run: rank 37 of 512"),
        ("cands = ck.plan(BIG", "(* model states exact, from a dry run of the rank)"),
        ("%colossal stop", "cluster stopped"),
    ],
    "09_mixture_of_experts.ipynb": [
        ("model(x)", "MoE layer 1: assignments per expert"),
        ("%colossal start -n 4", "started 4 ranks"),
        ("for step in range(40)", "engine: steps 1-40 · loss "),
        ("for step in range(40)", "        moe (2 layers): busiest expert "),
        ("for step in range(40)", " -> 2.00x the mean · dropped "),
        ("%colossal moe", "MoEView('engine' on 4 ranks, steps 1-40; recorded)"),
        ("%colossal moe", "no dispatch traffic: the experts are not split (ep=1)"),
        ("runs = {name: cluster.run(balanced", "no balancing                 2.00x"),
        ("runs = {name: cluster.run(balanced", "router bias 0.02"),
        ("print(picker.set(ep=3))", "so it must divide dp x sp: try ep=1, 2 or 4"),
        ("print(picker.set(ep=3))", "ok: dp=4 = 4 ranks, ep=4 fits the 4 ranks"),
        ("%colossal config dp=4 ep=4", "config set on 4 ranks: dp=4 = 4 ranks, ep=4"),
        ("GPTConfig(**MOE, router_bias_update=0.02)", "engine: steps 1-20 · loss "),
        ("GPTConfig(**MOE, router_bias_update=0.02)", "KiB to other ranks"),
        ("from colab_kit.expert.records import traffic", "B stayed home)"),
        ("bytes across tp pairs", "bytes across tp pairs (0-1, 2-3): 0"),
        ("single_process_losses(PARITY", "dp=2 tp=2 ep=2     losses"),
        ("single_process_losses(PARITY", "dp=4 ep=2 zero=1   losses"),
        ("single_process_losses(PARITY", "largest relative difference vs one process"),
        ("def hf_trained", "Mixtral dp=2 tp=2 ep=2   losses"),
        ("def hf_trained", "Mixtral dp=2 pp=2 ep=2   losses"),
        ("%colossal stop", "cluster stopped"),
    ],
}

ASKED = {  # notebooks that start `-n 8 --fit`: what they show on 8 ranks, and on 4 where memory is short (Binder)
    "02_tensor_parallel.ipynb": {
        8: [("%colossal start -n 8 --fit", "started 8 ranks"),
            ("probed:", "tp=8 (3d) = 8 ranks"),
            ('assert r["forward"] == f["forward"]', "backward  98,304 B (formula  98,304)"),
            ("dense_bytes", "tp=8 (3d) = 8 ranks              rank 0 holds"),
            ("largest relative difference", "2D on 8 ranks vs one process")],
        4: [("%colossal start -n 8 --fit", "starting 4 of the 8 asked for"),
            ("%colossal start -n 8 --fit", "started 4 ranks"),
            ("probed:", "planned only (they need 8 ranks, 4 started): tp=8 tp_mode=2.5d tp_depth=2, tp=8 tp_mode=3d"),
            ('assert r["forward"] == f["forward"]', "forward    planned (formula"),
            ("largest relative difference", "2D on 4 ranks vs one process")]},
    "06_hybrid_and_planner.ipynb": {
        8: [("cands = ck.plan(MODEL, RANKS", "candidates for 8 ranks,"),
            ("%colossal start -n $RANKS", "started 8 ranks"),
            ("before = cluster.run(first_part", "dp=2 tp=2 pp=2 microbatches=2: losses"),
            ("view.select(best)", "config set on 8 ranks: ")],
        4: [("cands = ck.plan(MODEL, RANKS", "beside a controller, not 8: starting 4 of the 8 asked for"),
            ("cands = ck.plan(MODEL, RANKS", "candidates for 4 ranks,"),
            ("%colossal start -n $RANKS", "started 4 ranks"),
            ("view.select(best)", "config set on 4 ranks: ")]},
    "07_bring_your_own_model.ipynb": {
        8: [("%colossal start -n 8 --fit", "started 8 ranks"),
            ("vit = {words: cluster.run", "tp=8 tp_mode=3d        loss 2.30"),
            ("bert, rotations = cluster.run", "BERT, dp=2 sp=4 ring (4 rotations of K/V per pass)"),
            ("gpt2 = cluster.run", "GPT-2, dp=2 tp=2 pp=2 schedule=zb-v chunks=2 microbatches=2 zero=1: largest relative"),
            ("net = cluster.run", "Net with its own policy, dp=2 tp=2 pp=2 microbatches=2: largest relative difference")],
        4: [("%colossal start -n 8 --fit", "starting 4 of the 8 asked for"),
            ("vit = {words: cluster.run", "dp=2 tp=2              loss 2.30"),
            ("bert, rotations = cluster.run", "BERT, sp=4 ring (4 rotations of K/V per pass)"),
            ("gpt2 = cluster.run", "GPT-2, tp=2 pp=2 schedule=zb-v chunks=2 microbatches=2: largest relative"),
            ("net = cluster.run", "Net with its own policy, tp=2 pp=2 microbatches=2: largest relative difference")]},
}
"""Where the browser tier runs, it runs every notebook under Binder's ``MEM_LIMIT`` (tests/binder_env.py), so
these start 4 engines there, and this file runs them with nbclient under this machine's memory (8 engines):
both sizes, each against its own expectations beside ``EXPECT``'s common ones. Except ``EIGHT_ELSEWHERE``."""

EIGHT_ELSEWHERE = {
    "02_tensor_parallel.ipynb":
        "its 8-rank run (29 s of a 23-minute suite) is left out: the browser tier runs it top to bottom on 4 ranks "
        "(1D and 2D measured, 2.5D and 3D planned), and what its 8 ranks add is each measured in tests/ranks: 2.5D and "
        "3D layers against their dense twins and their bytes against the formulas (test_tp2d, test_tp3d), 2D and 3D "
        "GPTs trained against one process on 8 ranks (test_tp2d, test_tp3d, test_parity_matrix); where the browser "
        "tier cannot run, test_notebooks.py still runs it with nbclient on this machine's memory",
    "06_hybrid_and_planner.ipynb":
        "its 8-rank run (22 s of a 21-minute suite) is left out: the browser tier runs it top to bottom on 4 ranks "
        "with the same cells (the plan, the top three measured, a checkpoint saved under one config and resumed under "
        "the plan's pick), and its 8-rank modes are each trained against one process in tests/ranks (dp x tp x pp in "
        "test_parity_matrix and test_pipeline_engine, checkpoints resharded between such layouts in test_checkpoint); "
        "where the browser tier cannot run, test_notebooks.py still runs it with nbclient on this machine's memory",
    "07_bring_your_own_model.ipynb":
        "its 8-rank run (72 s of a 21-minute suite) is left out: the browser tier runs it top to bottom on 4 ranks, "
        "and its modes (ViT 3d tp, BERT sp ring, GPT-2 zb-v, the user's Net over dp x tp x pp) are each trained "
        "against one process in tests/ranks (test_models, test_hf), on 2 to 8 ranks; where the browser tier cannot "
        "run, test_notebooks.py still runs it with nbclient on this machine's memory",
}
"""ASKED notebooks whose 8-rank run the suite leaves out where the browser tier runs the 4-rank one, and why."""


def _join(value) -> str:
    """A notebook string field: a str in memory, a list of lines in a saved .ipynb."""
    return "".join(value) if isinstance(value, list) else (value or "")


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append(_join(out.get("text", "")))
        parts.append("\n".join(out.get("traceback", [])))
        parts.append(_join(out.get("data", {}).get("text/plain", "")))
    return "".join(parts)


def expected_problems(name: str, cells, ranks: int | None = None) -> list[str]:
    """What ``EXPECT`` wants under each marker's cell that the executed ``cells`` (nbformat cells,
    or the dicts of a saved .ipynb) do not show; for a notebook in ``ASKED``, also what it shows on
    ``ranks`` engines (8, or 4 where memory was short)."""
    problems = []
    if name in ASKED and ranks not in ASKED[name]:
        problems.append(f"{name}: ran on {ranks} ranks, which ASKED does not expect (8, or 4 where memory is short)")
    for marker, expected in EXPECT.get(name, []) + ASKED.get(name, {}).get(ranks, []):
        hits = [c for c in cells if c["cell_type"] == "code" and marker in _join(c["source"])]
        if not hits:
            problems.append(f"{name}: no cell contains {marker!r}")
        elif not any(expected in _text(c) for c in hits):
            problems.append(f"{name}: the cell with {marker!r} did not show {expected!r}:\n{_text(hits[-1])[:2000]}")
    return problems


def temp_entries() -> set[str]:
    """The names in the temporary folder that the notebooks make there (``colab_kit_*``: 01's checkpoint, 06's
    folder). The library's own (``colab_kit-exits-*``, ``colab_kit-stacks-*``, ``colab_kit-dry-run-*``) go when the
    process that made them ends, which may be after the kernel is told to stop: tests/cluster checks those."""
    import tempfile

    return {p.name for p in Path(tempfile.gettempdir()).glob("colab_kit_*")}


def left_in_temp(name: str, before: set[str]) -> list[str]:
    """What ``name``'s run left in the temporary folder (``colab_kit_*`` names that were not there ``before``): a
    notebook removes what it makes there, or every run of it adds one (notebook 06 left a 3 MB checkpoint
    folder per run until it did)."""
    import tempfile

    left = sorted(temp_entries() - before)
    return [f"{name} left {left} in {tempfile.gettempdir()}: a notebook removes what it makes there"] if left else []


def started_ranks(cells) -> int | None:
    """The ranks the notebook's ``%colossal start`` started ("started 8 ranks ..."), None where it shows none."""
    for c in cells:
        found = re.search(r"started (\d+) ranks", _text(c)) if c["cell_type"] == "code" else None
        if found:
            return int(found.group(1))
    return None


def browser_missing() -> str | None:
    """Why the browser tier (tests/notebooks/test_browser.py) cannot run here, or None when it runs."""
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing (Debian: apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (pip install playwright)"
    return None


def browser_runs() -> bool:
    return browser_missing() is None
