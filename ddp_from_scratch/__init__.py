"""A hand-built DistributedDataParallel, taught in steps (naive -> flat -> bucketed).

Not written yet: see issue 3. The package exists so the distribution's layout is final.
"""
