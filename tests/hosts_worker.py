"""One process of a multi-process test run (tests/test_hosts.py spawns several).

    python tests/hosts_worker.py PORT COUNT INDEX OUT_DIR [frozen]

Joins the run on 127.0.0.1:PORT; first measures the resident memory an engine of the
larger model BIG takes in this process (OUT_DIR/rss-<index>.json: VmRSS before and after
building it, and its RAM tier's bytes of each kind); then trains each case of CASES
(tier, accum) for STEPS steps from the same initial weights on the same global batches,
and writes OUT_DIR/<case>.npz (process 0: the all-gathered master weights and optimizer
state) and OUT_DIR/<case>-<index>.json (this process's RAM-tier and store bytes of each
kind, the collectives' payload bytes, the losses). With `frozen`: trains the cases of
hosts_case.FROZEN instead (frozen leaves, LoRA), writing OUT_DIR/<case>.npz (process 0:
the master weights) and OUT_DIR/<case>-<index>.json (the losses).
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from pathlib import Path

import numpy as np

CASES = [("ram", 1), ("ram", 4), ("disk", 1), ("disk", 4)]


def vm_rss() -> int:
    """This process's resident set now, in bytes (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def main(port: int, count: int, index: int, out: Path, frozen: bool = False) -> None:
    import jax

    import mtjax.store
    from mtjax import distributed, hostmem, model, treepath
    from mtjax.config import DistributedConfig, StoreConfig, StreamConfig
    from mtjax.optim import make_optimizer
    from mtjax.stream import StreamEngine

    sys.path.insert(0, str(Path(__file__).parent))
    from hosts_case import BIG, CFG, FROZEN, FROZEN_ACCUM, OPT, batches

    startup = distributed.start(DistributedConfig(f"127.0.0.1:{port}", count, index, timeout_s=60))
    hosts = startup.hosts
    distributed.check_same(hosts, "test config", repr((CFG, OPT)))
    startup.done()

    @contextlib.contextmanager
    def engine_on(name: str, cfg, tier: str):
        """An engine of `cfg` from seed 1's weights, its state on `tier` (disk: this process's
        shard of a store under OUT_DIR/name): yields (engine, store or None); on leaving,
        the store is committed and both are closed."""
        store = None
        if tier == "disk":
            store = mtjax.store.create(out / name / hosts.shard.name, cfg,
                                       hosts={"index": index, "count": count, "run": "test"})
        engine = StreamEngine(cfg, model.init_params(cfg, seed=1), OPT, StreamConfig(keep_every=2),
                              StoreConfig(compute=tier, master=tier, opt=tier), store=store, hosts=hosts)
        try:
            yield engine, store
            if store is not None:
                engine.commit()
        finally:
            engine.close()
            if store is not None:
                store.close()
    if frozen:
        for name, (cfg, tier) in FROZEN.items():
            with engine_on(name, cfg, tier) as (engine, _):
                losses = [engine.step(b)["loss"] for b in batches(FROZEN_ACCUM)]
                params = engine.params()
            if index == 0:
                np.savez(out / f"{name}.npz", **{k: np.asarray(v) for k, v in treepath.flatten(params).items()})
            (out / f"{name}-{index}.json").write_text(json.dumps({"losses": losses}))
        jax.distributed.shutdown()
        return

    # First: VmRSS before the initial state of BIG is built and after an engine is built
    # from it and the caller has dropped it: the difference is what the engine keeps (its
    # tier's arrays, and any whole leaf one of them still holds on to). Every allocation
    # of 256 KiB or more has its own mmap, unmapped when freed (hostmem.fix_mmap_threshold):
    # freed memory does not stay resident. The state is built once before (its programs
    # compiled), and the optimizer state is given, as a resumed run's is, written
    # (np.full): fresh zeros would be pages the kernel gives the process only when the
    # first update writes them; a step would add its own memory (compiles, gradients).
    def initial():
        params = jax.block_until_ready(model.init_params(BIG, seed=1))
        return params, jax.tree.map(lambda a: np.full(a.shape, 0, a.dtype), make_optimizer(OPT).init(params))

    hostmem.fix_mmap_threshold()
    initial()
    gc.collect()
    before = vm_rss()
    params, opt_state = initial()
    engine = StreamEngine(BIG, params, OPT, StreamConfig(), StoreConfig(), hosts=hosts, opt_state=opt_state)
    del params, opt_state
    gc.collect()
    after = vm_rss()
    held = {kind: engine.tiers.by_kind[kind].nbytes(kind) for kind in ("compute", "master", "opt")}
    engine.close()
    del engine
    (out / f"rss-{index}.json").write_text(json.dumps({"before": before, "after": after, "held": held}))

    for tier, accum in CASES:
        name = f"{tier}-{accum}"
        with engine_on(name, CFG, tier) as (engine, store):
            hosts.sent = dict.fromkeys(hosts.sent, 0)  # this case's payload bytes
            losses = [engine.step(b)["loss"] for b in batches(accum)]
            ram = {kind: engine.tiers.by_kind[kind].nbytes(kind) for kind in ("compute", "master", "opt")
                   if tier == "ram"}
            stored = {kind: store.nbytes(kind) for kind in ("compute", "master", "opt")} if store else {}
            sent = dict(hosts.sent)  # the steps' collectives only
            kept = {"engine": not engine.derived_compute, "schedule": not engine.schedule.derived_compute,
                    "in_place": len(engine.schedule.in_place)}
            params, opt_state = engine.params(), engine.opt_state()
        if index == 0:
            flat = {f"params/{k}": np.asarray(v) for k, v in treepath.flatten(params).items()}
            flat.update({f"opt/{k}": np.asarray(v) for k, v in treepath.flatten(opt_state).items()})
            np.savez(out / f"{name}.npz", **flat)
        (out / f"{name}-{index}.json").write_text(json.dumps(
            {"losses": losses, "ram": ram, "stored": stored, "sent": sent, "compute_kept": kept}))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5:] == ["frozen"])
