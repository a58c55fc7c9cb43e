"""``BoostOptions``: what ``boost`` takes beside the model, the optimizer and the config, checked once and passed
as one object (to ``Engine``, then ``parallelize``, whose ``Build`` carries it to the parts).

``boost(model, optimizer, config, policy=..., loss_fn=..., bucket_bytes=..., device_budget=...,
max_grad_norm=..., lr_scheduler=...)`` keeps its keywords (the public names); it packs them here first thing,
and ``check(config)`` refuses a bad one before the model is read. Worked example, one rank of
``ParallelConfig(dp=2, zero=3, offload="auto")`` with a 1 GiB budget::

    >>> from colab_kit import ParallelConfig
    >>> opts = BoostOptions(device_budget=2**30, max_grad_norm=1.0)
    >>> opts.check(ParallelConfig(dp=2, zero=3, offload="auto"))
    >>> try:
    ...     BoostOptions().check(ParallelConfig(dp=2, zero=3, offload="auto"))
    ... except ConfigError as e:
    ...     print(str(e)[:62])
    offload='auto' places chunks under a device budget: pass boost
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import ConfigError, ParallelConfig
from .clipping import check_max_norm
from .loss import lm_loss

__all__ = ["BoostOptions"]


@dataclass(frozen=True)
class BoostOptions:
    """``boost``'s keyword options (its docstring says what each does)."""

    policy: Any = None
    """What each part of the model is (``colab_kit.policy.Policy``); after ``check_policy``, the one it found."""
    loss_fn: Callable = lm_loss
    """``(outputs, targets) -> loss`` of a microbatch (the default: next-token cross-entropy)."""
    bucket_bytes: int | None = None
    """The gradient all-reduce's bucket size (None: about a quarter of the gradients, 64 KiB to 25 MB)."""
    device_budget: int | None = None
    """``offload='auto'``: the bytes each rank's device may hold."""
    max_grad_norm: float | None = None
    """Clip every step's gradient to this global norm (None: no clipping)."""
    lr_scheduler: Any = None
    """A torch scheduler over the optimizer (or ``optimizer -> scheduler``), stepped once per step."""

    def check(self, config: ParallelConfig) -> None:
        """Refuse options that break a rule for ``config`` (a ``ConfigError`` with the rule and what works)."""
        budget = self.device_budget
        if config.offload == "auto" and budget is None:
            raise ConfigError("offload='auto' places chunks under a device budget: pass boost(..., "
                              "device_budget=BYTES), e.g. device_budget=2**30 for 1 GiB per rank")
        if budget is not None and config.offload != "auto":
            raise ConfigError(f"device_budget applies to offload='auto' (got offload={config.offload!r}): "
                              "set offload='auto' with zero=3, or drop device_budget")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0):
            raise ConfigError(f"device_budget must be a positive number of bytes, got {budget!r}")
        check_max_norm(self.max_grad_norm)
        if not callable(self.loss_fn):
            raise ConfigError(f"loss_fn must be a function (logits, targets) -> scalar loss, got "
                              f"{type(self.loss_fn).__name__}: e.g. loss_fn=torch.nn.functional.cross_entropy, or "
                              "leave it out for the mean token cross-entropy")
