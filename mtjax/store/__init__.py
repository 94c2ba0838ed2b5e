"""The layer store: a directory of per-part, per-leaf tensorstore arrays with atomic commits.

    import mtjax.store
    store = mtjax.store.create("run/store", cfg)          # or mtjax.store.open(path, writable=True)
    store.write("block.0", "master", arrays).result()
    store.commit(step=1, train_state={"rng": key_data, "cursor": 123})
    bufs = mtjax.store.BufferPool(store.schema("block.0", "compute")).acquire()
    store.read("block.0", "compute", out=bufs).result()

Modules: layout (directory and chunking), arrays (tensorstore I/O), buffers (reusable
host buffers), manifest (the commit point), lock (one writer), train_state (orbax),
store (the Store class), hf_import / hf_export / fresh (filling and emptying a store).
"""

from mtjax.store.buffers import BufferPool, empty_like_schema
from mtjax.store.errors import StoreError
from mtjax.store.layout import LAYOUT_VERSION
from mtjax.store.store import Store, create, open

__all__ = ["LAYOUT_VERSION", "BufferPool", "Store", "StoreError", "create", "empty_like_schema", "open"]
