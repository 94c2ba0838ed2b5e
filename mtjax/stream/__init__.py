"""The streaming engine: trains a model one part at a time through the device.

Stages, one module each, in the order data flows through them:

    tiers     where state lives: host RAM or the layer store on disk
    prefetch  bounded background loading, ahead of use
    staging   host staging buffers and the transfers of streamed parts and activations
    blockfns  the compiled per-kind functions (forward, recompute, backward, head)
    grads     gradients to host memory, summed over micro-batches
    update    one part's update: the fused AdamW loop, or an optax transformation's XLA program
    updater   the deferred updates: started once the clip scale is known, awaited per part
    commit    a one-copy store's commit protocol (state before the update + pending gradients)
    resident  parts kept on the device with their state, updated there
    schedule  one step described: transfers in order, bytes per link, device plan
    block_bytes  what one block holds on a device for its backward, which the plan adds up
    budget    the device ledger, which holds a step to its plan
    trace     per-part stage timings, Chrome trace JSON
    engine    the step, reading as those stages
"""

from mtjax.stream.budget import DeviceBudgetError
from mtjax.stream.engine import StreamEngine

__all__ = ["DeviceBudgetError", "StreamEngine"]
