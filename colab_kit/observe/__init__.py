"""Where a step's time goes, measured on every rank (memory has its own package, ``colab_kit.memory``).

    profile.py     ck.profile(engine): torch.profiler on every rank, each interval classed as compute,
                   communication by axis, copy or idle; the share of communication hidden behind compute
    throughput.py  tokens per second, FLOPs per step, achieved FLOP/s and MFU; the measured matmul peak
    roofline.py    ck.roofline(engine): where a step sits against this machine's compute and network roofs
    measured.py    this machine's measured constants as the planner caches them (read here, measured there)
"""
