"""The longest row a machine trains: the largest sequence length whose plan fits it.

    longest = longest.search(plan, fit.limits(hw))
    longest.seq, longest.plan          # tokens a row, and the plan at that length

Every part streams (no resident state, which only trades device memory for speed), the
run's batch, micro-batches, recompute groups, placement and devices stay as configured,
the kept block inputs wait on the device or in host RAM and the feed-forwards (MoE too) run
whole or over chunks of FFN_CHUNK tokens (model.ffn_chunk_tokens, when the config sets
none), whichever lets the row grow longer. What grows with the row is priced as at any
length: kept inputs, vjp residuals (traced, mtjax.stream.block_bytes.residual_bytes), the
hidden states between parts, the chunked head (mtjax.loss.head_bytes, flat but for a
per-token share), the host's kept inputs and token buffers. The model's own context (max_position_embeddings) is not a
bound here: the report states it beside the answer.
"""

from __future__ import annotations

import dataclasses
import itertools

from mtjax.plan.cost import Plan, estimate
from mtjax.plan.fit import Limits, short_of
from mtjax.units import count

STEP = 1024  # the answer is a multiple of this many tokens
FFN_CHUNK = 4096  # model.ffn_chunk_tokens tried where the config sets none
LIMIT = 2**24  # searched up to this many tokens a row


@dataclasses.dataclass(frozen=True)
class Longest:
    seq: int  # tokens a row (0: not even STEP tokens fit)
    plan: Plan | None  # the plan at `seq` (None when nothing fits)
    context: int  # the model's max_position_embeddings, for the reader


def search(plan: Plan, room: Limits) -> Longest:
    """The longest row (a multiple of STEP, at most LIMIT) whose plan under `plan`'s
    settings, every part streamed, fits `room`; with kept inputs on the device or the
    host, the feed-forward whole or chunked, whichever reaches further. Memory grows with
    the row, so a bisection finds it."""
    best = Longest(0, None, plan.cfg.max_position_embeddings)
    cfgs = [plan.cfg]
    if not plan.cfg.ffn_chunk_tokens:
        cfgs.append(dataclasses.replace(plan.cfg, ffn_chunk_tokens=FFN_CHUNK))
    for cfg, activations in itertools.product(cfgs, ("device", "host")):
        stream = dataclasses.replace(plan.stream, resident=(), activations=activations)

        def at(steps: int, cfg=cfg, stream=stream) -> Plan:
            shape = dataclasses.replace(plan.shape, seq=steps * STEP)
            return estimate(cfg, stream, plan.store, shape, plan.hardware, part_bytes_=plan.part_bytes,
                            devices=plan.schedule.devices)

        lo, hi = 0, 1  # at(lo) fits (0: nothing yet), at(hi) is the next to try
        while hi * STEP <= LIMIT and not short_of(at(hi), room):
            lo, hi = hi, 2 * hi
        hi = min(hi, LIMIT // STEP + 1)
        while hi - lo > 1:  # at(lo) fits, at(hi) does not (or is past LIMIT)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if not short_of(at(mid), room) else (lo, mid)
        if lo * STEP > best.seq:
            best = Longest(lo * STEP, at(lo), best.context)
    return best


def describe(longest: Longest) -> str:
    """One line for `mtjax plan`: the length, what it needs, and the model's context."""
    context = f"the model's context is {longest.context:,}"
    if longest.plan is None:
        return f"no row of {STEP} tokens fits with every part streamed ({context})"
    p = longest.plan
    chunked = f", model.ffn_chunk_tokens={p.cfg.ffn_chunk_tokens}" if p.cfg.ffn_chunk_tokens else ""
    return (f"{longest.seq:,} tokens a row with every part streamed, kept inputs on the "
            f"{p.stream.activations}{chunked} "
            f"(device {p.device.total / 2**30:.1f} GiB, host RAM {p.ram_needed / 2**30:.1f} GiB, "
            f"{count(p.tokens_per_s)} tokens/s); {context}")
