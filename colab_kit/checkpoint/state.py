"""What a checkpoint's manifest holds beside the tensors, as JSON holds it: the LR scheduler's state (``plain`` and
its inverse ``unplain``) and the optimizer's numeric hyperparameters per param group (``hyperparameters``, put back
by ``restore_hyperparameters`` as ``torch.optim.Optimizer.load_state_dict`` would).

Worked example, AdamW with two param groups (decay and no decay) under a ``MultiStepLR``::

    hyperparameters(group)   -> {"lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-08, "weight_decay": 0.1,
                                 "initial_lr": 0.003}          (foreach, fused, amsgrad: flags, not saved)
    plain(sched.state_dict()) -> {"milestones": {"__items__": [[30, 1], [60, 1]], "__counter__": true}, ...}
    unplain(that)            -> {"milestones": Counter({30: 1, 60: 1}), ...}   (the keys back as numbers)

Every rank saves and loads the same values (a rank's manifest is rank 0's).
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch

from .files import CheckpointError

__all__ = ["plain", "unplain", "hyperparameters", "restore_hyperparameters"]


def plain(v):
    """``v`` (a scheduler's state) as JSON holds it: tensors and numpy numbers as numbers, tuples as lists, a
    dict whose keys are not all strings (``MultiStepLR``'s milestones, a ``Counter``) as ``{"__items__":
    [[key, value], ...]}`` so that ``_unplain`` gives the same keys back."""
    import collections
    if torch.is_tensor(v):
        return v.tolist()
    if hasattr(v, "item") and hasattr(v, "dtype") and not isinstance(v, (list, tuple, dict)):  # a numpy number
        return v.item()
    if isinstance(v, dict):
        if all(isinstance(k, str) for k in v) and not isinstance(v, collections.Counter):
            return {k: plain(x) for k, x in v.items()}
        return {"__items__": [[plain(k), plain(x)] for k, x in v.items()],
                "__counter__": isinstance(v, collections.Counter)}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise CheckpointError(f"the LR scheduler's state holds a {type(v).__name__}, which a checkpoint's manifest "
                          f"cannot hold: use a torch scheduler whose state is numbers (LambdaLR over functions, ...)")


def unplain(v):
    """The inverse of ``_plain`` for what it tags."""
    import collections
    if isinstance(v, dict):
        if "__items__" in v:
            d = {(tuple(k) if isinstance(k, list) else k): unplain(x) for k, x in v["__items__"]}
            return collections.Counter(d) if v.get("__counter__") else d
        return {k: unplain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [unplain(x) for x in v]
    return v


def _number(v):
    """``v`` as a JSON number (or list of numbers) when it is a numeric hyperparameter, else None."""
    if torch.is_tensor(v) and v.numel() == 1:
        v = v.item()
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return v
    if isinstance(v, (tuple, list)) and v and all(_number(x) is not None for x in v):
        return [_number(x) for x in v]
    return None


def hyperparameters(group: dict) -> dict:
    """A param group's numeric hyperparameters (not its parameters, not its flags)."""
    return {k: n for k, v in group.items() if k != "params" and (n := _number(v)) is not None}


def restore_hyperparameters(opt, saved: list[dict] | None, path: str) -> None:
    if not saved:  # a checkpoint from before they were saved
        return
    groups = opt.param_groups
    pairs: Iterable[tuple[dict, dict]]
    if len(saved) == len(groups):
        pairs = zip(groups, saved)
    elif all(g == saved[0] for g in saved):
        pairs = ((g, saved[0]) for g in groups)
    else:
        warnings.warn(f"{path} holds {len(saved)} optimizer param groups with different hyperparameters and this "
                      f"engine {len(groups)}: the engine keeps its own (lr {[g.get('lr') for g in groups]})",
                      stacklevel=4)  # the line that called engine.load (-> load -> _restore_hyper)
        return
    for group, values in pairs:
        for k, v in values.items():
            now = group.get(k)
            if torch.is_tensor(now):
                now.fill_(v)
            else:
                group[k] = tuple(v) if isinstance(now, tuple) or (now is None and isinstance(v, list)) else v
