"""The exchange: moving bytes between data-parallel ranks, and what is sent.

- ``comm``: the ``Comm`` interface and its torch.distributed, MPI and in-process backends;
- ``plan``: a bucket's slices, sections and route, and the byte sizes every rank expects;
- ``headers``: the control and codec headers every message opens with, checked on the device;
- ``encode``: sections into wire bytes with their codec, counted;
- ``feedback``: error-feedback residuals;
- ``reducer``: one bucket's reduce-scatter (the direct route), ``relay``: the relay route;
- ``two_level``: inside the node first, then among the nodes;
- ``fidelity``: the sampled exact reduction telemetry compares with;
- ``param_gather``: the compressed parameter all-gather;
- ``stats``: the per-step counters every part adds into.

No DeepSpeed here: the seam (``deepspeed_gift.zero``) describes buckets and partitions to it.
"""
