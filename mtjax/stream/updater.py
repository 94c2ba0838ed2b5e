"""The deferred update: step n's optimizer update of each part runs after step n's
backward, once the clip scale is known, and before the part is staged for step n + 1.

    updater.ready(scale)         the step's gradients are final: start every update
    updater.updated(part)        wait for the part's update (the next step's prefetch)
    updater.compute_into(...)    the part's compute weights, into a staging slot
    updater.flush()              apply every pending update (before state is read)

`Updater` is the engine's one handle on three pieces: state access (`State`,
mtjax.stream.state: tier reads and writes, the writes' tracking and throttling, the
derived compute copy), the update queue (`UpdateQueue`, mtjax.stream.updates: which
update runs when, on which thread) and disk read-ahead (`ReadAhead`,
mtjax.stream.readahead). An update reads master and optimizer state from their tiers,
runs `PartUpdate` (the fused AdamW loop, or the XLA program of another optax
transformation), and writes the results back. On disk an update also starts the reads
of the next pending part's master and optimizer state, so the disk reads it while this
part's update computes and its writes queue; the backward reads the first updates' state
the same way (`read_early`). Before an update makes new state it waits for the writes of
the update before last. Its new compute copy is handed to the part's next staging, which
copies it into the slot instead of reading it back from a disk tier.
"""

from __future__ import annotations

from mtjax.stream.grads import GradSink
from mtjax.stream.readahead import ReadAhead
from mtjax.stream.state import State
from mtjax.stream.tiers import Tiers
from mtjax.stream.trace import Tracer
from mtjax.stream.update import PartUpdate
from mtjax.stream.updates import UpdateQueue


class Updater:
    """State access, the update queue and read-ahead of one engine.

    `parts`: part names in the order the forward needs them. `derived_compute`: no
    compute copy is kept; the staged copy is rounded from master (docs/device.md).
    `scale`: the clip scale of updates already pending (a resumed one-copy store's).
    """

    def __init__(self, parts: list[str], update: PartUpdate, tiers: Tiers, grads: GradSink, tracer: Tracer,
                 derived_compute: bool, one_copy=None, scale: float | None = None,
                 hosts=None, schemas: dict | None = None):
        enabled = hosts is None and any(tiers.placement[k] == "disk" for k in ("master", "opt"))
        self.read_ahead = ReadAhead(parts, tiers, grads, enabled)
        self.state = State(tiers, tracer, update.policy, derived_compute, on_write=self.read_ahead.forget)
        self.updates = UpdateQueue(parts, update, self.state, self.read_ahead, grads, tracer, one_copy, scale,
                                   hosts, schemas)
        self.grads = grads
        # State access
        self.kept_in_ram, self.read, self.write = self.state.kept_in_ram, self.state.read, self.state.write
        self.wait_writes, self.round_master = self.state.wait_writes, self.state.round_master
        self.write_kept = self.state.write_kept
        # The update queue
        self.ready, self.start, self.updated = self.updates.ready, self.updates.start, self.updates.updated
        self.settle, self.flush = self.updates.settle, self.updates.flush

    @property
    def scale(self):
        """The clip scale of the pending updates (on the host device), or None."""
        return self.updates.scale

    def compute_into(self, part: str, out: dict, fresh: dict | None) -> None:
        """The part's compute weights into a staging slot (`State.compute_into`). A derived
        copy is rounded on the fused AdamW's ranked threads at the part's rank: ahead of the
        pieces of every update the forward needs later. On threads of its own it ran beside
        all of them, and the first blocks of a GPU step waited 0.1-0.2 s for it."""
        self.state.compute_into(part, out, fresh, self.updates.ranked(part))

    def order(self, parts) -> None:
        """The parts in the order the next forward needs them (a schedule's `needed`): the
        updates, and the reads ahead of them, follow it."""
        self.updates.order(parts)
        self.read_ahead.order(parts)

    def read_early(self, updated) -> list[str]:
        """The step's reads of compute weights are done (its prefetch has loaded every
        transfer) while its backward goes on: start the reads the step's updates (of the
        parts in `updated`: not the resident ones) will make first, for as many parts as
        read buffer sets are free; returns those parts. The disk then works through the
        rest of the backward instead of idling until the clip scale is known."""
        return self.read_ahead.early(updated)

    def close(self) -> None:
        self.updates.close()
        self.read_ahead.close()  # reads started for updates that will not run (a step that failed)
