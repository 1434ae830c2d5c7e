"""Tensor parallelism: one replica's model split over several devices (Megatron style).

group.py holds the collectives, sharding.py splits a loaded transformers model, and
workers.py runs ranks 1..N-1 as Ray actors; rank 0 is the replica's own model runner.
"""
