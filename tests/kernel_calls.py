"""Which compiled kernels a piece of code runs: tests assert that a path took the kernels it
claims (one batched encode, the fused feedback step) by recording them, not by timing."""

import contextlib


@contextlib.contextmanager
def compiled_calls(*, block: bool = False):
    """Inside, every call of a kernel that ``kernels.compiled`` makes is recorded, in order, in
    the list yielded: its function's name, or (``block``) the name and its ``block`` constant."""
    from deepspeed_gift.core import kernels

    calls, real = [], kernels.compiled

    def recording(fn, **constants):
        run = real(fn, **constants)

        def call(*args):
            calls.append((fn.__name__, constants.get("block")) if block else fn.__name__)
            return run(*args)
        return call

    kernels.compiled = recording
    try:
        yield calls
    finally:
        kernels.compiled = real
