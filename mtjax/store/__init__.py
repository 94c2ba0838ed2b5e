"""The layer store: a directory of per-part, per-leaf tensorstore arrays with atomic commits.

    import mtjax.hostmem, mtjax.store
    store = mtjax.store.create("run/store", cfg)          # or mtjax.store.open(path, writable=True)
    store.write("block.0", "master", arrays).result()
    store.commit(step=1, train_state={"rng": key_data, "cursor": 123})
    bufs = mtjax.hostmem.BufferPool().acquire(store.schema("block.0", "compute"))
    store.read("block.0", "compute", out=bufs).result()  # fills bufs in place

    mtjax.store.import_hf("hf_ckpt", "run/store"); mtjax.store.export_hf("run/store", "out")

Modules: layout (directory and chunking), arrays (tensorstore arrays), chunks (reads
straight into buffers), manifest (the commit point), lock (one writer), pending
(checksummed gradient files of updates still to apply), train_state (a JSON file per
commit), store (the Store class) and its pieces: slots (the slot table), io (chunk
reads and writes), commit (every commit protocol), checks (what an opened store must
be); fill / hf_import / hf_export / fresh (filling a new
store and exporting one); shards (a multi-process run's store) and reshard (it rewritten
for another number of processes).
"""

from mtjax.store.errors import StoreError
from mtjax.store.fresh import init_store
from mtjax.store.hf_export import export_hf
from mtjax.store.hf_import import import_hf
from mtjax.store.layout import LAYOUT_VERSION
from mtjax.store.store import Store, create, open

__all__ = ["LAYOUT_VERSION", "Store", "StoreError", "create", "export_hf", "import_hf", "init_store", "open"]
