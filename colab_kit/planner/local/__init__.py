"""The local cost model: seconds per step of a config on THIS machine's CPU ranks, from constants measured here.

``ck.plan`` without ``hardware=`` and ``ck.estimate(..., hardware="this machine")`` price with it: the compute at
the measured matmul, per-op and per-byte rates, each collective at its measured ``alpha + wire / beta``, the
pipeline's schedule simulated on the cores its ranks share.

- ``constants.py``: ``constants(ranks=4)``: measure with local ranks, fit, cache; ``LOCAL``, this machine's name
- ``measure_rank.py``: one rank's measurements: compute windows, the optimizer, each collective in a running loop
- ``measure_compute.py``: the compute a rank times (``Burst``), the timing windows, ``count_ops``
- ``step.py``: ``step_seconds``: one config's step: compute, collectives, bubble, optimizer
- ``comm.py``: the step's collectives: tp, sp and dp, ZeRO's buckets and gathers
- ``bubble.py``: the pipeline's bubble: the schedule's own plan simulated with each action's costs
- ``shared_cores.py``: ``makespan`` of a schedule whose ranks share fewer cores than there are ranks
- ``validate.py``: the plan against runs: boost the top candidates, train a few steps, compare
"""
