"""Mixture of experts in both cost models: its shape, its price on a cluster, its step on this machine.

- ``shape.py``: ``ModelShape`` of an MoE (the built-in MoE GPT, a Hugging Face MoE on the meta device), its memory
- ``price.py``: what experts add to ``cluster.price``: the expert GEMMs, the all-to-all, the edp reduction
- ``local.py``: the local plan of the built-in MoE GPT: its ep configs, its step as the dense GPT a token sees
  plus the all-to-alls
"""
