"""`mtjax train` with a kill -9 planted inside the store's commit (tests/test_hosts.py,
tests/test_store_one_copy.py).

    MTJAX_TEST_KILL=prepared:3 python tests/hosts_train.py --run.dir=... ...

SIGKILLs this process when its store's commit of generation 3 reaches the phase named
(mtjax.store.commit.PHASES), e.g. a shard's `prepared` (before the barrier: no process can
have committed) or `finish` (after the barrier, before its own rename: another process
may have committed), or `committed` (the manifest renamed, nothing after it done).
"""

import os
import signal
import sys

from mtjax import cli
from mtjax.store import commit

kill_phase, _, kill_generation = os.environ.get("MTJAX_TEST_KILL", ":").partition(":")


def kill_at(store, phase, generation):
    if phase == kill_phase and str(generation) == kill_generation:
        os.kill(os.getpid(), signal.SIGKILL)


commit.observe(kill_at)
sys.exit(cli.main(["train", *sys.argv[1:]]))
