"""What the benchmark programs share, so that benchmarks/ lists only the programs a user runs:

    cases.py             each collective's buffers and its closed-form check (#wrong)
    sweep.py             the sizes of a sweep, its dtypes and settings, and their checks
    nccl_format.py       nccl-tests' table: algbw, busbw, #wrong, the size labels
    bandwidth_rounds.py  the bandwidth benchmark's rounds, alternating backends
    bandwidth_report.py  its report: medians, spread, which backend wins over which sizes
    limits.py            the machine's own limit at each size (a copy of the same bytes)
    busbw_plot.py        busbw against size, a line a backend
    prediction.py        the cost model's prediction beside a measurement
"""
