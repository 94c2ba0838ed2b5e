"""The streaming engine: trains a model one part at a time through the device.

Stages, one module each, in the order data flows through them:

    tiers     where state lives: host RAM or the layer store on disk
    prefetch  bounded background loading, ahead of use
    staging   host staging buffers and every host<->device transfer
    blockfns  the compiled per-kind functions (forward, recompute, backward, head)
    grads     gradients to host memory, summed over micro-batches
    update    the per-part optax update on the CPU
    budget    device byte accounting
    trace     per-part stage timings, Chrome trace JSON
    engine    the step, reading as those stages
"""

from mtjax.stream.budget import DeviceBudgetError
from mtjax.stream.engine import StreamEngine, StreamOptions

__all__ = ["DeviceBudgetError", "StreamEngine", "StreamOptions"]
