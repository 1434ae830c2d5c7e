"""Tensor parallelism: one replica's model split over several devices (Megatron style).

group.py holds the collectives, sharding.py splits a loaded transformers model,
workers.py runs ranks 1..N-1 as Ray actors, and tp_runner.py is rank 0: the replica's
own model runner, which sends each step to the workers before running it.
"""
