"""`mtjax train` with a kill -9 planted inside the store's commit (tests/test_hosts.py).

    MTJAX_TEST_KILL=prepared:3 python tests/hosts_train.py --run.dir=... ...

SIGKILLs this process when its shard's commit of generation 3 reaches the phase named:
`prepared` (its shard prepared, before the barrier: no process can have committed) or
`finish` (after the barrier, before its own rename: another process may have committed).
"""

import os
import signal
import sys

import mtjax.store.store as store_mod
from mtjax import cli

phase, _, generation = os.environ.get("MTJAX_TEST_KILL", ":").partition(":")
prepare_commit, finish_commit = store_mod.Store._commit, store_mod.Store.finish_commit


def _commit(self, *args, **kwargs):
    prepare_commit(self, *args, **kwargs)
    if phase == "prepared" and self._prepared is not None and str(self._prepared.generation) == generation:
        os.kill(os.getpid(), signal.SIGKILL)


def _finish(self):
    if phase == "finish" and self._prepared is not None and str(self._prepared.generation) == generation:
        os.kill(os.getpid(), signal.SIGKILL)
    finish_commit(self)


store_mod.Store._commit, store_mod.Store.finish_commit = _commit, _finish
sys.exit(cli.main(["train", *sys.argv[1:]]))
