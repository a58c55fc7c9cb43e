"""Expert tensor parallelism (ETP) against what the engine does: the fourth comparison of ``bench/moe.py``.

Issue 42 asked to measure before building ETP (torchtitan dropped it as not worth it on skinny experts). Two
CPU ranks on gloo, one thread each; one expert layer (the local sort by expert, the gather, the grouped experts
``expert_compute(how="grouped_mm")``, the router-weighted combine), forward + backward, for ``N`` tokens per
rank routed top-k over ``E`` experts, in four forms::

    replicated  the engine under 1D tp today: both ranks hold all E experts whole and compute the same N
                tokens; no collective
    etp         Megatron-Core's ETP: each expert split over its width f, w_in [E, d, f/2] column-parallel
                and w_out [E, f/2, d] row-parallel; both ranks compute the same N tokens on their halves, the
                [N k, d] expert output all-reduced in forward (Megatron's g) and the [N k, d] input gradient
                in backward (f)
    etp tokens  the same split with f and g moved to the tokens ([N, d]: before the gather, after the
                combine): k times fewer bytes on the wire, the cheapest place for them
    fold        the pair folded into ep: each rank its own N tokens and E/2 experts whole, the rows
                dispatched and combined by all_to_all (``colab_kit.expert.ExpertParallel``, the engine at ep=2)

Time per token-layer is a form's time over the distinct tokens the pair processes: N for the first three, 2N
for fold (twice the tokens in the same pair of ranks). So ``etp / replicated = t_etp / t_replicated`` and
``etp / fold = (t_etp / N) / (t_fold / 2N) = 2 t_etp / t_fold``; e.g. t_etp 20 ms, t_fold 30 ms: 1.33 (ETP
spends a third more time per token). Each round runs the forms in turn (the first form rotating from round
to round), ``repeat`` layers each between barriers; a ratio is the median over rounds of that round's ratio.
Before timing, each form's output on this rank is checked against one process's layer on the same tokens.
"""
from __future__ import annotations

import statistics
import time

import torch

import colab_kit as ck
from colab_kit.comm import copy_to_group, reduce_from_group
from colab_kit.expert import ExpertParallel
from colab_kit.models.experts import Experts, combine, dispatch, expert_compute

SIZES = {  # Mixtral 8x7B: 8 experts top-2, f = 3.5 d; DeepSeek-V3: 256 experts top-8, f = 0.29 d
    "Mixtral-like (wide)": dict(experts=8, top_k=2, d=256, f=896, tokens=512),
    "DeepSeek-like (skinny)": dict(experts=64, top_k=8, d=256, f=64, tokens=512),
}
FORMS = ("replicated", "etp", "etp tokens", "fold")


def _tokens(n, d, e, k, seed):
    """``n`` tokens ``[n, d]`` routed top-``k`` of ``e`` at random: (x, chosen [n, k], weights [n, k])."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    chosen = torch.rand(n, e, generator=g).topk(k, dim=1).indices
    weights = torch.rand(n, k, generator=g).softmax(-1)
    return x, chosen, weights


def _layer(x, chosen, weights, experts, n_experts, mesh=None, axis=None):
    """One expert layer: sort by expert, gather, ``experts(rows, counts)``, combine. With ``mesh``: f before the
    gather and g after the combine (the "etp tokens" placement)."""
    if mesh is not None:
        x = copy_to_group(x, mesh, axis)
    order, counts = dispatch(chosen, None, n_experts)
    out = combine(experts(x[order // chosen.shape[1]], counts), order, weights)
    return reduce_from_group(out, mesh, axis) if mesh is not None else out


def _forms(size: dict, tp_mesh, ep_mesh, rank: int):
    """Each form as a function of no argument running one layer forward + backward, and its output."""
    e, k, d, f, n = (size[key] for key in ("experts", "top_k", "d", "f", "tokens"))
    g = torch.Generator().manual_seed(7)
    whole = [torch.randn(*s, generator=g).mul_(0.05) for s in ((e, d, f), (e, f), (e, f, d), (e, d))]
    half = slice(rank * f // 2, (rank + 1) * f // 2)
    cut = [whole[0][:, :, half], whole[1][:, half], whole[2][:, half, :], whole[3] / 2]  # b_out: half on each
    full_w = [w.clone().requires_grad_() for w in whole]
    etp_w = [w.contiguous().requires_grad_() for w in cut]
    module = Experts(e, d, f)
    with torch.no_grad():
        for name, w in zip(("w_in", "b_in", "w_out", "b_out"), whole):
            getattr(module, name).copy_(w)
    ep = ExpertParallel(module, ep_mesh, "ep")
    same = _tokens(n, d, e, k, seed=11)  # the tp pair's tokens, equal on both ranks
    own = _tokens(n, d, e, k, seed=12 + rank)  # this rank's tokens under ep

    def grouped(ws):
        return lambda rows, counts: expert_compute(rows, counts, *ws, how="grouped_mm")

    def etp_rows(rows, counts):
        rows = copy_to_group(rows, tp_mesh, "tp")
        return reduce_from_group(expert_compute(rows, counts, *etp_w, how="grouped_mm"), tp_mesh, "tp")

    calls = {"replicated": (same, grouped(full_w), {}), "etp": (same, etp_rows, {}),
             "etp tokens": (same, grouped(etp_w), {"mesh": tp_mesh, "axis": "tp"}), "fold": (own, ep, {})}
    params = {"replicated": full_w, "etp": etp_w, "etp tokens": etp_w, "fold": list(ep.parameters())}

    def make(form):
        (x, chosen, weights), experts, kw = calls[form]
        x = x.clone().requires_grad_()  # the layer's input gradient is computed, as inside a model
        grad = torch.ones(n, d).div_(n)

        def run():
            for p in [x, *params[form]]:
                p.grad = None
            out = _layer(x, chosen, weights, experts, e, **kw)
            out.backward(grad)
            return out.detach()
        return run
    runs = {form: make(form) for form in FORMS}
    errors = {}
    for form, inputs in (("replicated", same), ("etp", same), ("etp tokens", same), ("fold", own)):
        want = _layer(*inputs, grouped(whole), e).detach()
        got = runs[form]()
        errors[form] = float((got - want).abs().max() / want.abs().max())
    return runs, errors


def etp_rank(rounds: int, repeat: int) -> dict:
    """On each of the 2 ranks: ``{size name: {"ms": {form: [per round]}, "max_rel": {form: float}}}``."""
    torch.manual_seed(0)
    rank = torch.distributed.get_rank()
    tp_cfg, ep_cfg = ck.ParallelConfig(tp=2), ck.ParallelConfig(dp=2, ep=2)
    tp_mesh, ep_mesh = ck.ProcessMesh.shared(tp_cfg), ck.ProcessMesh.shared(ep_cfg)
    out = {}
    for name, size in SIZES.items():
        runs, errors = _forms(size, tp_mesh, ep_mesh, rank)
        ms: dict[str, list[float]] = {form: [] for form in FORMS}
        for r in range(rounds + 1):  # round 0 warms up, untimed
            for i in range(len(FORMS)):
                form = FORMS[(r + i) % len(FORMS)]
                torch.distributed.barrier()
                t0 = time.perf_counter()
                for _ in range(repeat):
                    runs[form]()
                torch.distributed.barrier()
                if r:
                    ms[form].append(1e3 * (time.perf_counter() - t0) / repeat)
        out[name] = {"ms": ms, "max_rel": errors}
    tp_mesh.release()
    ep_mesh.release()
    return out


def etp_rows(res: dict, row) -> tuple[list[dict], dict]:
    """The rows of ``bench/results/moe.json`` from rank 0's ``etp_rank``: for each size, ETP / replicated and
    ETP / fold per token-layer, and the figures (per-round ms, the medians, the checks)."""
    rows, figures = [], {"sizes": SIZES, "forms": FORMS}
    for name, size in SIZES.items():
        ms = res[name]["ms"]
        med = {form: statistics.median(ts) for form, ts in ms.items()}
        per_token = {form: 1e3 * t / (size["tokens"] * (2 if form == "fold" else 1)) for form, t in med.items()}
        ratio = {(a, b): statistics.median([x / y * (2 if b == "fold" else 1) for x, y in zip(ms[a], ms[b])])
                 for a in ("etp", "etp tokens") for b in ("replicated", "fold")}
        figures[name] = {"ms": ms, "median_ms": med, "min_ms": {form: min(ts) for form, ts in ms.items()}, "us_per_token": per_token, "max_rel": res[name]["max_rel"],
                         "ratios": {f"{a} / {b}": v for (a, b), v in ratio.items()}}
        what = (f"expert tensor parallelism, {name}: {size['experts']} experts top-{size['top_k']}, d {size['d']}, "
                f"f {size['f']}, {size['tokens']} tokens/rank, fwd+bwd, 2 CPU ranks")
        us = {form: f"{v:.1f} us/token" for form, v in per_token.items()}
        rows.append(row(f"{what}: ETP / replicated under tp", f"ETP {us['etp']}", f"replicated {us['replicated']}",
                        ratio[("etp", "replicated")], f"ETP with f/g on the tokens: {ratio[('etp tokens', 'replicated')]:.2f}; "
                        "median of per-round ratios; < 1.00: ETP faster"))
        rows.append(row(f"{what}: ETP / fold into ep", f"ETP {us['etp']}", f"fold into ep=2 {us['fold']}",
                        ratio[("etp", "fold")], f"ETP with f/g on the tokens: {ratio[('etp tokens', 'fold')]:.2f}; "
                        "per token: fold runs 2x the tokens; < 1.00: ETP faster"))
    return rows, figures
