"""Benchmarks: ecshare against the baselines it has to beat (``python -m ecshare bench ...``).

May import: anything in ecshare.
"""
