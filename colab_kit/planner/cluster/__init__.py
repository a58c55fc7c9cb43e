"""The at-scale cost model: one training step of a config on a GPU cluster, from the model's shape and a node preset
(``ck.estimate(..., hardware=<preset>)``, ``ck.plan(..., hardware=<preset>)``, ``ck.dry_run``'s step times).

- ``price.py``: ``price``: the step (compute, bubble, exposed comm per axis, optimizer); ``compute_floor``
- ``compute.py``: one block's compute on a rank: each GEMM at its shape's rate, attention by kernel, the rest at HBM
- ``comm.py``: a collective on the cluster: a group's ranks placed on nodes, NVLink inside, the NICs across
- ``terms.py``: the terms ``price`` adds: tp and sp collectives of a block, the params a rank holds, the optimizer
- ``hardware.py``: ``Hardware`` and the node presets ``HARDWARE``, each figure sourced; ``hardware_constants``
- ``stack.py``: ``Stack``: the software a node runs (attention's kernel, fusion, overlap); ``STACKS``
- ``curve_fit.py``: a preset fitted on the curves measured on the GPU itself (``bench/gpu_curves.py``)
- ``tp_traffic.py``: the bytes one rank sends for a block under each tensor mode, by group size
"""
