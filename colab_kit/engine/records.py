"""What an ``Engine`` reports about itself: memory by category and place (measured, and the
estimate beside it), recorded collectives, the last step's timeline, its parameters whole.

A mixin of ``colab_kit.engine.core.Engine`` (the training side lives there); it reads the engine's
parts through their named methods (``grads.nbytes``, ``grads.host_bytes``, ``grads.gathered``, ...).
"""
from __future__ import annotations

import torch

from ..measure import optimizer_bytes, tensor_bytes
from ..checkpoint import load, save
from ..checkpoint.pretrained import dense_state_dict, load_pretrained, save_pretrained
from ..memory.estimator import config_estimate, model_activations, traced_activations
from ..memory.formulas import estimate, optimizer_states, placed
from ..models import GPTConfig

__all__ = ["EngineRecords"]

_STATE_NAMES = {0: "sgd-nomomentum", 1: "sgd-momentum", 2: "adamw"}  # fp32 states per parameter -> estimator name


class EngineRecords:
    """Records of one rank's engine (see ``colab_kit.engine.core.Engine``)."""

    def memory(self) -> dict:
        """Measured bytes on this rank: params, grads, optimizer, activations (see colab_kit.memory),
        and where they live: ``"device"`` and ``"host"``, each a dict of the same four categories
        whose sum is the total.

        Held now, between steps: with ZeRO the optimizer states of this rank's pieces (1/dp of
        them, plus padding) and, at stage 2, only the gradient pieces (see colab_kit.zero). The
        device is the rank's accelerator; on a machine without one it is an account of the same
        host memory (``offload`` moves what it names to the "host" side of that account)::

            {"params": 441344, "grads": 441344, "optimizer": 882836, "activations": 2328836,
             "device": {"params": 441344, ..., "activations": 2328836},
             "host": {"params": 0, "grads": 0, "optimizer": 0, "activations": 0}, "step_peak": None}

        ``step_peak``: the most bytes held at once inside a step. On a GPU the allocator's peak over the
        last step (``torch.cuda.max_memory_allocated``, reset as each step begins: every step, free). On
        CPU no allocator counts: the peak of the last ``memory_timeline`` (``colab_kit.memory.timeline``),
        None before one ran.
        """
        totals = {"params": self._param_bytes(), "grads": self.grads.nbytes,  # fp32 masters are optimizer state
                  "optimizer": optimizer_bytes(self.optimizer) + self.grads.master_bytes(),
                  "activations": self.activation_meter.peak}
        host = dict.fromkeys(totals, 0)
        host.update(self.grads.host_bytes(self.optimizer))
        return {**totals, "device": {k: totals[k] - host[k] for k in totals}, "host": host, "step_peak": self.step_peak}

    def _param_bytes(self) -> int:
        held = self.grads.param_bytes()  # ZeRO-3: this rank's shards (and what is gathered now)
        return held if held is not None else tensor_bytes(self.module.parameters())

    def memory_estimate(self) -> dict:
        """The estimate of ``memory()`` from ``colab_kit.memory.estimator.config_estimate``, the one ``ck.plan``
        ranks candidates by: the ZeRO paper's formulas for the model states of this rank's
        parameters (counted per tensor mode and pipeline stage), and the GPT activation count in this
        config's layout for the last step's batch (0 before a step). Another model: the model states
        of its measured parameter count and, with a policy, the activations of its dense forward traced on the
        meta device, scaled by this layout's share (``estimate.model_activations``). Same keys as
        ``memory()``, "device" and "host" included."""
        try:
            states = optimizer_states(self.optimizer)
        except ValueError:
            states = "adamw"
        cfg = self.config
        name = states if isinstance(states, str) else _STATE_NAMES[states]
        share = self.grads.host_share()
        rows, seq = self._rows or 0, getattr(self, "_seq", None)
        micro = self.pipeline.microbatch_shape() if self.pipeline is not None else None
        if micro:  # with pp: the executor's microbatches of the last step
            rows, seq = micro
        model = self.model_cfg  # the dense model's config, also with pp
        if isinstance(model, GPTConfig):  # a GPT: the planner's estimate
            shards = self.tp_plan.batch_shards if self.tp_plan is not None else 1
            seq = seq or model.seq_len
            seq = seq * cfg.sp if self.sp_plan is not None else seq  # the engine keeps this rank's tokens
            est = config_estimate(model, cfg, rows * shards * cfg.dp * cfg.microbatches, name, seq=seq,
                                  pp_rank=self.mesh.rank("pp"), host_share=share)
            if not rows:
                est = placed({**{k: est[k] for k in ("params", "grads", "optimizer")}, "activations": 0},
                             cfg.zero, cfg.offload, share)
            return est
        est = estimate(self._n_local, name, dp=cfg.dp, zero=cfg.zero, precision=cfg.precision, offload=cfg.offload)
        est["activations"] = 0
        shape = getattr(self, "_input", None)  # (the last step's global input shape, its dtype)
        if self.policy is not None and shape is not None:
            cache = self.__dict__.setdefault("_traced", {})  # the dense trace, once per input shape
            if shape not in cache:
                cache.clear()
                cache[shape] = traced_activations(self.dense_twin, *shape, cfg.precision)
            est["activations"] = model_activations(self.dense_twin, self.policy, cfg, *shape,
                                                   pp_rank=self.mesh.rank("pp"), traced=cache[shape])
        return placed(est, cfg.zero, cfg.offload, share)

    def placements(self) -> list[dict]:
        """This rank's parameters and how each lies on the mesh, in DTensor's terms (``colab_kit.placement``)::

            {"name": "blocks.0.mlp.fc1.weight", "shape": (16, 32),
             "placements": "tp: Shard(0), dp: Replicate()"}            # tp=2, dp=2, tp_mode '1d'
        """
        axes = [a for a in self.mesh.layout.fine_names if self.mesh.size(a) > 1 and a != "pp"]
        return [{"name": n, "shape": s, "placements": d} for n, s, d in self.placement_table.rows(axes)]

    def comm(self, last_step: bool = False) -> list[dict]:
        """This rank's recorded collectives (all, or those of the last step)."""
        log = self.mesh.log
        return log.as_dicts(log.last_step() if last_step else None)

    def timeline(self) -> list[dict]:
        """This rank's events of the last step: name, kind (compute/comm), start and end in seconds."""
        return sorted(self.events, key=lambda e: e["start"])

    def save(self, path, extra: dict | None = None) -> None:
        """A sharded checkpoint of this engine at ``path`` (every rank calls it), written atomically;
        ``extra``: a dict saved with it and returned by ``load`` (see ``colab_kit.checkpoint``)."""
        save(self, path, extra)

    def load(self, path) -> dict:
        """Load a checkpoint saved by an engine of any config (same model) and continue from its
        step; returns the ``extra`` dict given to ``save`` (see ``colab_kit.checkpoint``)."""
        return load(self, path)

    def dense_state_dict(self, dst: int = 0) -> dict | None:
        """The dense model's parameters (fp32, the dense model's names) on rank ``dst``, None on the other
        ranks; every rank calls it (``checkpoint.pretrained.dense_state_dict``). Load it into the model built
        in one process: ``GPT(cfg).load_state_dict(sd)`` (tied weights appear once)."""
        return dense_state_dict(self, dst)

    def save_pretrained(self, directory) -> None:
        """Write a Hugging Face model's ``save_pretrained`` directory (safetensors) that ``transformers``
        loads back unchanged, from every rank's shards (every rank calls it; ``checkpoint.pretrained``)."""
        save_pretrained(self, directory)

    def load_pretrained(self, directory) -> int:
        """Read a local ``save_pretrained`` directory into this engine's shards, each rank reading only the
        rectangle of each matrix its elements lie in; the optimizer's states are left as they are
        (``checkpoint.pretrained``). Returns how many elements this rank read."""
        return load_pretrained(self, directory)

    def state_vector(self) -> torch.Tensor:
        """All parameters flattened into one CPU vector (for checking ranks agree)."""
        with self.gathered():
            return torch.cat([p.detach().reshape(-1).cpu() for p in self.module.parameters()])

    def gathered(self):
        """A context in which every parameter of ``self.module`` is whole (ZeRO stage 3 gathers
        them, and frees them after); with other configs nothing to do."""
        return self.grads.gathered()

