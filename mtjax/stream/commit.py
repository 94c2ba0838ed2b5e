"""The commit protocol of a one-copy store (store.copies=1), in one place.

A one-copy store holds a single copy of the state on disk, so an update may not
overwrite it until the state it replaces can be rebuilt. Each step is therefore
committed as "the state before its update + the step's gradients" (docs/store.md):

    one_copy = OneCopy(store, tiers)       # the durable gradient files: one_copy.spill
    scale = one_copy.adopt(grads)          # resume: the committed gradients are pending again
    one_copy.step_finished()               # a step's gradients are final; its updates must wait
    one_copy.commit(step, state, grads, scale)   # durable: state + gradients; updates may run
    one_copy.part_updated(part)            # a part's new state committed; its gradient files go

The store provides the atomic steps (`commit` with `pending`, `commit_part`); this object
decides when each one happens.
"""

from __future__ import annotations

import concurrent.futures as cf

from mtjax.errors import MtjaxError
from mtjax.store.layout import pending_key
from mtjax.stream.grads import GradSink
from mtjax.store.pending import PendingFiles
from mtjax.stream.tiers import Tiers


class OneCopy:
    def __init__(self, store, tiers: Tiers):
        if tiers.kinds_in("ram"):
            raise MtjaxError("a one-copy store (store.copies=1) holds every kind of state: set store.compute, "
                             "store.master and store.opt to 'disk', or use store.copies=2")
        self.store = store
        # Gradient sums wait for their update in the store's pending directory, fsynced,
        # and stay until the part's new state is committed.
        self.spill = PendingFiles(directory=store.pending_dir)
        self._uncommitted = False  # this step's gradients are not yet in a commit
        self._tag = None  # the tag of the committed pending gradients (their file names)

    def adopt(self, grads: GradSink) -> float | None:
        """Resume mid-update: the gradients the store's last commit names become `grads`'
        pending sums; returns their clip scale (None: nothing was pending)."""
        pending = self.store.pending
        if not pending:
            return None
        for part in pending["parts"]:  # fp32 sums, shaped like the master weights
            self.spill.adopt(pending_key(part, pending["tag"]), self.store.schema(part, "master"))
        grads.adopt(pending["parts"], pending["tag"])
        self._tag = pending["tag"]
        return float(pending["scale"])

    def step_finished(self) -> None:
        """A step's gradients are final: no update of it may run before its commit."""
        self._uncommitted = True

    def check_may_update(self, part: str, grads: GradSink) -> None:
        if self._uncommitted and part in grads.pending():
            raise MtjaxError("with a one-copy store a step must be committed (engine.commit(step, train_state)) "
                             "before its update may overwrite the only copy of the state")

    def commit(self, step: int, train_state: dict | None, grads: GradSink, scale) -> None:
        """Commit `step` as the state before its update plus its pending gradients (the
        caller has let every update in flight and every write finish)."""
        parts, tag = grads.pending(), grads.ready_tag()
        pending = None if not parts else {"tag": tag, "parts": parts, "scale": float(scale)}
        self.store.commit(step, train_state, pending=pending)
        self._uncommitted, self._tag = False, tag

    def part_updated(self, part: str) -> cf.Future:
        """Once the part's new state is written, commit it, then delete its gradient files
        (`grads.take` left them: until this commit a crash needs them)."""
        key = pending_key(part, self._tag)
        return self.store.commit_part(part, after=lambda: self.spill.forget(key))
