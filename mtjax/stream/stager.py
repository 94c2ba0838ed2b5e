"""Stage a part: the prefetch worker's pending update, read into a staging slot, transfer.

    stager = Stager(cfg, pool, tracer, split, updater, schemas)
    feed = stager.feed(schedule, schedule.transfers, depth)   # a Prefetcher of (slot, weights)
    ...                                                          # the runner's `Stage` operations take them
    stager.close(feed)                                           # slots staged and never taken go back

The parts staged are the schedule's `transfers` (a training step) or `forward` (an
evaluation), in order: the runner's `Stage` operations take them in that order.

On the CPU backend with fp32 compute and no compute copy kept (the derived copy,
docs/device.md), a whole part is staged as its master arrays themselves: the device
reads host memory there, so copying master into a slot only to hand the slot to
`device_put` moved 8 bytes/param per step for nothing. The schedule says which parts
(`schedule.in_place`, from `step_parts.staged_in_place`): it gives them no slot and prices
no staging copy for them. The master arrays are safe to
alias: the deferred update overwrites them only once every gradient of the step is in
(every program that read them has finished), and the next staging of the part waits
for that update (`updater.updated`).
"""

from __future__ import annotations

from mtjax.partid import PartId
from mtjax.stream.prefetch import Prefetcher
from mtjax.stream.schedule import unit_schema


class Stager:
    def __init__(self, cfg, pool, tracer, split, updater, schemas):
        self.cfg, self.pool, self.tracer, self.split = cfg, pool, tracer, split
        self.updater, self.schemas = updater, schemas
        self.schedule = None

    def load(self, part: PartId):
        """Prefetch worker: pending update, then read into a staging slot, then device_put.
        A split MoE block's sub-part (`part.is_sub`) stages some of its block's leaves: an
        expert group only the experts some token reached."""
        owner = part.owner
        fresh = self.updater.updated(owner)
        if part in self.schedule.in_place:
            # Staged as the master arrays themselves, no slot (the module's docstring).
            master = self.updater.read(owner, "master")  # (timed as "read")
            start = self.tracer.now()
            slot, weights = self.pool.put_host({n: master[n] for n in self.schemas[owner]}, part)
            self.tracer.watch("h2d", part, weights, since=start)
            return slot, weights
        if part in self.schedule.adapters:  # its frozen leaves: its adapters are resident
            slot, leaves = self.pool.acquire(unit_schema(self.cfg, part, {}, self.schedule.adapters)), None
        elif not part.is_sub:
            slot, leaves = self.pool.acquire(self.schemas[owner]), None
        else:
            groups = self.schedule.split[part.block]
            sub = unit_schema(self.cfg, part, self.schedule.split)
            slot, leaves = self.pool.acquire(sub), self.split.staged(part, sub, groups)
        with self.tracer.span("read", part):
            if leaves is None or leaves:
                self.updater.compute_into(owner, slot.buffers if leaves is None else
                                          {n: slot.buffers[n] for n in leaves}, fresh)
        start = self.tracer.now()
        weights = self.pool.put(slot, part, leaves)
        self.tracer.watch("h2d", part, weights, since=start)  # until the device copy is ready
        return slot, weights if not part.is_sub else self.split.complete(part, sub, groups, weights)

    def feed(self, schedule, names, depth: int, after=None) -> Prefetcher:
        """A prefetcher staging `names` of `schedule` (its transfers, or its forward) in order;
        `after` runs on its worker once the last is staged."""
        self.schedule = schedule
        return Prefetcher(names, self.load, depth, after=after)

    def close(self, feed: Prefetcher) -> None:
        """Stop the prefetcher and hand back the slots it staged that no operation took."""
        self.split.routing.cancel()  # a prefetch worker waiting for routing that will not come
        for slot, _ in feed.close():
            self.pool.release(slot, [])
