"""``ck.dry_run``: what rank r of a run far larger than this machine holds, built for real in a fresh process under
torch's fake process group (no peers, no values); and ``ck.plan(..., exact=k)``, which dry-runs its first k.

- ``run.py``: ``dry_run``, ``dry_run_many``: every check, then one process for all the ranks asked
- ``child.py``: that process: each rank built by ``boost``, tensors given storage and no values, optimizer states made
- ``report.py``: ``DryRunReport``, with the step time under each hardware (a cluster preset, or local constants)
- ``exact.py``: ``exact_states``: the plan's first k candidates, their model states made exact by dry runs
"""
