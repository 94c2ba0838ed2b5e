"""One process of a multi-process test run (tests/test_hosts.py spawns several).

    python tests/hosts_worker.py PORT COUNT INDEX OUT_DIR

Joins the run on 127.0.0.1:PORT, then trains each case of CASES (tier, accum) for
STEPS steps from the same initial weights on the same global batches, and writes
OUT_DIR/<case>.npz (process 0: the all-gathered master weights and optimizer state)
and OUT_DIR/<case>-<index>.json (this process's RAM-tier and store bytes of each kind,
the collectives' payload bytes, the losses).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

CASES = [("ram", 1), ("ram", 4), ("disk", 4)]


def main(port: int, count: int, index: int, out: Path) -> None:
    import jax

    import mtjax.store
    from mtjax import distributed, model, treepath
    from mtjax.config import DistributedConfig, StoreConfig, StreamConfig
    from mtjax.stream import StreamEngine

    sys.path.insert(0, str(Path(__file__).parent))
    from hosts_case import CFG, OPT, batches

    startup = distributed.start(DistributedConfig(f"127.0.0.1:{port}", count, index, timeout_s=60))
    hosts = startup.hosts
    distributed.check_same(hosts, "test config", repr((CFG, OPT)))
    startup.done()
    for tier, accum in CASES:
        name = f"{tier}-{accum}"
        store = None
        if tier == "disk":
            store = mtjax.store.create(out / name / hosts.shard.name, CFG,
                                       hosts={"index": index, "count": count, "run": "test"})
        placement = StoreConfig(compute=tier, master=tier, opt=tier)
        engine = StreamEngine(CFG, model.init_params(CFG, seed=1), OPT, StreamConfig(keep_every=2), placement,
                              store=store, hosts=hosts)
        hosts.sent = dict.fromkeys(hosts.sent, 0)  # this case's payload bytes
        losses = [engine.step(b)["loss"] for b in batches(accum)]
        ram = {kind: engine.tiers.by_kind[kind].nbytes(kind) for kind in ("compute", "master", "opt") if tier == "ram"}
        stored = {kind: store.nbytes(kind) for kind in ("compute", "master", "opt")} if store else {}
        sent = dict(hosts.sent)  # the steps' collectives only
        params, opt_state = engine.params(), engine.opt_state()
        if store is not None:
            engine.commit()
        engine.close()
        if store is not None:
            store.close()
        if index == 0:
            flat = {f"params/{k}": np.asarray(v) for k, v in treepath.flatten(params).items()}
            flat.update({f"opt/{k}": np.asarray(v) for k, v in treepath.flatten(opt_state).items()})
            np.savez(out / f"{name}.npz", **flat)
        (out / f"{name}-{index}.json").write_text(json.dumps(
            {"losses": losses, "ram": ram, "stored": stored, "sent": sent}))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
