"""The layer store's Python API: round trips, buffers, slots, commits, locking, checksums, bad input."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from pathlib import Path

import jax
import numpy as np
import pytest

import mtjax.store
from mtjax import hostmem, model, parts
from mtjax.model_config import ModelConfig, RopeScaling
from mtjax.store import commit, durable, layout
from mtjax.store import io as store_io
from mtjax.store.errors import StoreError

from conftest import tiny_config

CFG = tiny_config(intermediate_size=48, compute_dtype="bfloat16")
KINDS = parts.KINDS


def values(store, seed: int) -> dict:
    """A distinct random value for every leaf of every (part, kind), reproducible from `seed`."""
    out = {}
    for i, part in enumerate(store.parts):
        for j, kind in enumerate(KINDS):
            rng = np.random.default_rng([seed, i, j])
            out[part, kind] = {
                leaf: (rng.integers(0, 1 << 20, s.shape) if np.dtype(s.dtype).kind == "i"
                       else rng.standard_normal(s.shape)).astype(s.dtype)
                for leaf, s in store.schema(part, kind).items()
            }
    return out


def write_all(store, vals) -> None:
    futures = [store.write(p, k, a) for (p, k), a in vals.items()]
    for f in futures:
        assert f.result() is None


def read_all(store) -> dict:
    futures = {(p, k): store.read(p, k) for p in store.parts for k in KINDS}
    return {key: f.result() for key, f in futures.items()}


def same(a: dict, b: dict) -> bool:
    """Bit-for-bit equality of two {(part, kind): {leaf: array}} states."""
    return a.keys() == b.keys() and all(
        a[k].keys() == b[k].keys() and all(a[k][n].tobytes() == b[k][n].tobytes() and a[k][n].dtype == b[k][n].dtype
                                           for n in a[k]) for k in a)


@pytest.fixture
def filled(tmp_path):
    """A store at step 1 holding values(seed=1)."""
    store = mtjax.store.create(tmp_path / "s", CFG)
    vals = values(store, 1)
    write_all(store, vals)
    store.commit(1)
    yield store, vals
    store.close()


def test_create_schema_and_sizes(tmp_path):
    import optax

    store = mtjax.store.create(tmp_path / "s", CFG)
    assert store.step == 0 and store.config == CFG
    recorded = json.loads((tmp_path / "s" / layout.MANIFEST).read_text())
    assert recorded["dtypes"] == {"compute": "bfloat16", "master": "float32", "checkpoint": "float32"}
    assert recorded["layout_version"] == layout.LAYOUT_VERSION and recorded["step"] == 0
    assert store.parts == ["embed", "block.0", "block.1", "head"]
    tx = mtjax.make_optimizer(mtjax.OptimConfig())
    for p in store.parts:
        for k in KINDS:
            assert store.schema(p, k) == parts.schema(CFG, p, k, tx)
    assert store.schema("block.0", "compute")["mlp.up_proj.kernel"].dtype == jax.numpy.bfloat16
    assert store.nbytes("master") == 4 * model.num_params(CFG)
    assert store.nbytes("compute") == 2 * model.num_params(CFG)
    assert store.nbytes() == sum(store.nbytes(k) for k in KINDS)
    assert store.nbytes("opt", "head") == parts.nbytes(parts.schema(CFG, "head", "opt", tx))
    with pytest.raises(StoreError, match="never been written"):
        store.read("embed", "master")
    with pytest.raises(StoreError, match="no part 'block.7'"):
        store.schema("block.7", "master")
    store.close()
    # a store made for another optimizer records that optimizer's state leaves
    sgd = mtjax.store.create(tmp_path / "sgd", CFG, tx=optax.sgd(0.1, momentum=0.9))
    assert sgd.schema("head", "opt") == parts.schema(CFG, "head", "opt", optax.sgd(0.1, momentum=0.9))
    sgd.close()


def test_round_trip_every_kind_and_reopen(filled, tmp_path):
    store, vals = filled
    assert same(read_all(store), vals)
    store.close()
    reopened = mtjax.store.open(tmp_path / "s")
    assert reopened.step == 1 and not reopened.writable
    assert same(read_all(reopened), vals)
    assert reopened.disk_usage() >= reopened.nbytes()


def test_a_read_result_lives_only_as_long_as_its_caller_holds_it(filled, tmp_path):
    """A reader going part by part (export, reshard) holds one part: the store keeps the
    order of each (part, kind)'s I/O, not the arrays its reads returned."""
    import weakref

    store, vals = filled
    store.close()
    with mtjax.store.open(tmp_path / "s") as reader:
        gone = []
        for part in reader.parts:
            got = reader.read(part, "master").result()
            assert same({0: got}, {0: vals[part, "master"]})
            gone += [weakref.ref(a) for a in got.values()]
            del got
        assert gone and [r() for r in gone] == [None] * len(gone)


def test_reads_fill_pool_buffers_in_place(filled):
    store, vals = filled
    schema = store.schema("block.1", "master")
    pool = hostmem.BufferPool(sets_per_shape=2)
    a, b = pool.acquire(schema), pool.acquire(schema)
    for buf in (*a.values(), *b.values()):
        assert buf.ctypes.data % 4096 == 0 and buf.flags.writeable
    assert all(a[n] is not b[n] for n in a)  # both sets are out: two sets
    for _ in range(2):  # reused: the same memory every time
        got = store.read("block.1", "master", out=a).result()
        assert all(got[n] is a[n] for n in a)
        assert same({0: got}, {0: vals["block.1", "master"]})
        pool.release(a)
        assert pool.acquire(schema) is a


def test_bad_read_buffers(filled):
    store, _ = filled
    schema = store.schema("head", "master")
    good = hostmem.BufferPool().acquire(schema)
    with pytest.raises(StoreError, match="missing"):
        store.read("head", "master", out={})
    wrong = dict(good, **{"norm.weight": np.empty(3, np.float32)})
    with pytest.raises(StoreError, match="norm.weight"):
        store.read("head", "master", out=wrong)
    frozen = {n: a.copy() for n, a in good.items()}
    frozen["norm.weight"].flags.writeable = False
    with pytest.raises(StoreError, match="writable"):
        store.read("head", "master", out=frozen)


def test_uncommitted_writes_are_read_back_but_not_committed(filled, tmp_path):
    store, old = filled
    new = values(store, 2)
    write_all(store, {k: v for k, v in new.items() if k[0] == "block.0"})
    now = read_all(store)
    assert same({k: now[k] for k in now if k[0] == "block.0"}, {k: new[k] for k in new if k[0] == "block.0"})
    assert same({k: now[k] for k in now if k[0] != "block.0"}, {k: old[k] for k in old if k[0] != "block.0"})
    # a second reader sees only the committed step
    assert same(read_all(mtjax.store.open(tmp_path / "s")), old)
    store.close()  # without commit: the writes are dropped
    assert same(read_all(mtjax.store.open(tmp_path / "s")), old)


def test_commit_makes_writes_current_and_alternates_slots(filled, tmp_path):
    store, _ = filled
    root = tmp_path / "s"
    for step, seed in ((2, 2), (3, 3), (4, 4)):
        vals = values(store, seed)
        write_all(store, vals)
        store.commit(step)
        with mtjax.store.open(root) as reader:
            assert reader.step == step and same(read_all(reader), vals)
        slots = json.loads((root / layout.MANIFEST).read_text())["slots"]
        assert {s for kinds in slots.values() for s in kinds.values()} == {"a" if step % 2 == 1 else "b"}


def test_write_then_read_same_part_is_ordered(filled):
    store, _ = filled
    for seed in range(5, 9):  # no waiting in between: each read must see the write before it
        vals = values(store, seed)["block.0", "opt"]
        store.write("block.0", "opt", vals)
        assert same({0: store.read("block.0", "opt").result()}, {0: vals})


def test_a_read_does_not_queue_behind_writes(filled):
    """Writes held up (a busy disk) must not hold up a read of other state: the next
    computation waits for reads, while nothing waits for the writes until the commit."""
    store, vals = filled
    release, started = threading.Event(), threading.Semaphore(0)

    def slow_write(event, *args):
        if event == "write":
            started.release()
            release.wait(30)

    stop = durable.observe(slow_write)  # the store I/O layer's seam: each chunk write waits first
    try:
        new = values(store, 7)
        writes = [store.write(p, k, new[p, k]) for p in store.parts for k in ("master", "opt")]
        for _ in range(store_io.IO_THREADS):  # every write thread is taken
            assert started.acquire(timeout=30)
        read = store.read("block.0", "compute")
        assert same({0: read.result(timeout=30)}, {0: vals["block.0", "compute"]})
        assert not any(w.done() for w in writes)
    finally:
        release.set()
        stop()
    for w in writes:
        w.result(timeout=60)
    assert same({0: store.read("head", "opt").result()}, {0: new["head", "opt"]})


def test_one_writer_many_readers(filled, tmp_path):
    store, vals = filled
    with pytest.raises(StoreError, match="already open for writing"):
        mtjax.store.open(tmp_path / "s", writable=True)
    reader = mtjax.store.open(tmp_path / "s")
    assert same(read_all(reader), vals)
    with pytest.raises(StoreError, match="read-only"):
        reader.write("head", "master", vals["head", "master"])
    with pytest.raises(StoreError, match="read-only"):
        reader.commit(5)
    store.close()
    mtjax.store.open(tmp_path / "s", writable=True).close()  # the lock went with the writer


def test_bad_writes_are_refused_before_any_io(filled, tmp_path):
    store, vals = filled
    good = vals["block.0", "master"]
    key = "mlp.up_proj.kernel"
    cases = {
        "missing": {k: v for k, v in good.items() if k != key},
        "extra": {**good, "mlp.extra.kernel": good[key]},
        "shape": {**good, key: good[key][:, :-1]},
        "dtype": {**good, key: good[key].astype(np.float64)},
        "type": {**good, key: good[key].tolist()},
    }
    for name, arrays in cases.items():
        with pytest.raises(StoreError, match="block.0 master"):
            store.write("block.0", "master", arrays)
    with pytest.raises(StoreError, match="step"):
        store.commit(-1)
    store.commit(2)
    assert same(read_all(mtjax.store.open(tmp_path / "s")), vals)


def test_existing_directory_is_never_overwritten(filled, tmp_path):
    with pytest.raises(StoreError, match="not empty"):
        mtjax.store.create(tmp_path / "s", CFG)
    with pytest.raises(StoreError, match="no store"):
        mtjax.store.open(tmp_path / "nothing")
    with pytest.raises(StoreError, match="not an mtjax store"):
        mtjax.store.open(tmp_path)


def test_store_for_another_config(filled, tmp_path):
    other = dataclasses.replace(CFG, intermediate_size=40)
    with pytest.raises(StoreError, match="another model config.*intermediate_size 48 -> 40"):
        mtjax.store.open(tmp_path / "s", config=other)
    mtjax.store.open(tmp_path / "s", config=CFG).close()
    # a manifest swapped in from another model's store: refused by identity, and without
    # the identity (stores made before it) because it does not match the arrays' schema
    filled[0].close()
    elsewhere = mtjax.store.create(tmp_path / "o", other)
    elsewhere.close()
    (tmp_path / "s" / layout.MANIFEST).write_bytes((tmp_path / "o" / layout.MANIFEST).read_bytes())
    with pytest.raises(StoreError, match="comes from another store"):
        mtjax.store.open(tmp_path / "s")
    (tmp_path / "s" / layout.STORE_ID).unlink()
    older = json.loads((tmp_path / "s" / layout.MANIFEST).read_text())
    (tmp_path / "s" / layout.MANIFEST).write_text(json.dumps({**older, "store_id": None}))  # as before STORE_ID
    with pytest.raises(StoreError, match="different models"):
        mtjax.store.open(tmp_path / "s")


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name, says", [
    (layout.MANIFEST, "has lost its manifest.json (the commit point naming which of its files hold the last step) "
                      "but still holds data (parts/, train_state/): it cannot be opened, and nothing in it was "
                      "changed; put back manifest.json from a backup of this store, or delete"),
    (layout.STORE_ID, "has lost its STORE_ID file, which identifies it; if manifest.json is this store's own, "
                      "write its store_id back: echo "),
    (layout.SCHEMA, "has lost its schema.json file (the shape and dtype of every array it holds): it cannot be "
                    "opened; put back schema.json"),
])
def test_a_store_missing_an_identity_file_is_refused_and_kept(filled, tmp_path, name, says):
    """Each file that identifies a store, deleted: opening it (to read or to write) says
    which file is missing and what to do, and changes nothing; put back, it opens again."""
    store, vals = filled
    store.commit(2, {"step": 2})
    store.close()
    root = tmp_path / "s"
    saved = (root / name).read_bytes()
    (root / name).unlink()
    before = files_of(root)
    for writable in (False, True):
        with pytest.raises(StoreError, match=re.escape(says)):
            mtjax.store.open(root, writable=writable)
    assert files_of(root) == before | ({layout.LOCK: b""} if layout.LOCK not in before else {})
    if name == layout.STORE_ID:  # the message's own fix
        (root / name).write_text(json.loads((root / layout.MANIFEST).read_text())["store_id"] + "\n")
    else:
        (root / name).write_bytes(saved)
    with mtjax.store.open(root) as reopened:
        assert reopened.step == 2 and same(read_all(reopened), vals)


def test_a_trainer_keeps_a_store_whose_manifest_is_gone(filled, tmp_path):
    """A run's store without its manifest is not taken for the leftover of a stopped
    creation (which a run removes and starts over): the run is refused, the data kept."""
    from mtjax import checkpoint
    from mtjax import config

    store, _ = filled
    store.close()
    root = tmp_path / "s"
    (root / layout.MANIFEST).unlink()
    before = files_of(root)
    exp = config.load(None, [f"store.path={root}", f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(StoreError, match="has lost its manifest.json"):
        checkpoint.open_run_store(exp, CFG)
    assert files_of(root) == before


def test_manifest_of_a_twin_store_is_refused(tmp_path):
    """Same model, same step and generation: only the store identity tells them apart."""
    for name in ("a", "b"):
        mtjax.store.create(tmp_path / name, CFG).close()
    before = (tmp_path / "a" / layout.MANIFEST).read_bytes()
    (tmp_path / "a" / layout.MANIFEST).write_bytes((tmp_path / "b" / layout.MANIFEST).read_bytes())
    with pytest.raises(StoreError, match="comes from another store"):
        mtjax.store.open(tmp_path / "a", writable=True)
    (tmp_path / "a" / layout.MANIFEST).write_bytes(before)
    mtjax.store.open(tmp_path / "a", writable=True).close()


def test_newer_layout_version_is_refused(filled, tmp_path):
    filled[0].close()
    path = tmp_path / "s" / layout.MANIFEST
    d = json.loads(path.read_text())
    d["layout_version"] = layout.LAYOUT_VERSION + 1
    path.write_text(json.dumps(d))
    with pytest.raises(StoreError, match="newer than this mtjax supports"):
        mtjax.store.open(tmp_path / "s")
    d["layout_version"] = layout.LAYOUT_VERSION
    del d["slots"]["block.1"]
    path.write_text(json.dumps(d))
    with pytest.raises(StoreError, match="malformed slot table"):
        mtjax.store.open(tmp_path / "s")
    path.write_text("{not json")
    with pytest.raises(StoreError, match="corrupt"):
        mtjax.store.open(tmp_path / "s")


def _chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / layout.PARTS_DIR).rglob("*") if p.is_file() and p.name != "zarr.json")


def test_flipped_byte_anywhere_is_detected_and_named(filled, tmp_path):
    filled[0].close()
    root = tmp_path / "s"
    rng = np.random.default_rng(0)
    files = _chunk_files(root)
    assert len(files) > 40
    for path in [files[i] for i in rng.choice(len(files), 12, replace=False)]:
        part, kind_slot, leaf = path.relative_to(root / layout.PARTS_DIR).parts[:3]
        kind = kind_slot.split(".")[0]
        original = path.read_bytes()
        flipped = bytearray(original)
        flipped[rng.integers(len(flipped))] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(flipped))
        with mtjax.store.open(root) as store:
            with pytest.raises(StoreError, match=f"{part} {kind} tensor {leaf} .*corrupt"):
                store.read(part, kind).result()
        path.write_bytes(original)
    # metadata: a changed byte in zarr.json is caught when the array is opened
    meta = root / layout.PARTS_DIR / "block.1" / "master.a" / "mlp.down_proj.kernel" / "zarr.json"
    text = meta.read_text()
    meta.write_text(text.replace('"float32"', '"float64"'))
    with mtjax.store.open(root) as store:
        with pytest.raises(StoreError, match="block.1 master tensor mlp.down_proj.kernel"):
            store.read("block.1", "master")
    meta.write_text(text)
    # a deleted chunk is an error, not zeros
    files[0].unlink()
    with mtjax.store.open(root) as store:
        part, kind = files[0].relative_to(root / layout.PARTS_DIR).parts[0], files[0].parent.parent.name.split(".")[0]
        with pytest.raises(StoreError, match="corrupt or unreadable"):
            read_all(store)


def test_train_state_round_trip_and_cleanup(filled, tmp_path):
    store, _ = filled
    assert store.load_train_state() is None
    state = {"step": 7, "rng": np.asarray(jax.random.key_data(jax.random.key(3))), "lr_step": 7,
             "loader": {"epoch": 1, "offset": 4096, "order": np.arange(5, dtype=np.int64)},
             "config": {"optim": {"lr": 3e-4, "schedule": "cosine"}, "name": "run", "tags": ["a", 1], "none": None}}
    store.commit(7, train_state=state)
    ts_dir = tmp_path / "s" / layout.TRAIN_STATE_DIR
    (ts_dir / "g00000099-step00000008").mkdir()  # leftover of an interrupted commit
    store.close()
    store = mtjax.store.open(tmp_path / "s", writable=True)
    got = store.load_train_state()
    assert got["rng"].dtype == state["rng"].dtype and np.array_equal(got["rng"], state["rng"])
    assert np.array_equal(got["loader"]["order"], state["loader"]["order"])
    assert {k: v for k, v in got["loader"].items() if k != "order"} == {"epoch": 1, "offset": 4096}
    assert got["config"] == state["config"] and got["step"] == 7 and got["lr_step"] == 7
    assert [p.name for p in ts_dir.iterdir()] == [json.loads((tmp_path / "s" / layout.MANIFEST).read_text())["train_state"]]
    with pytest.raises(StoreError, match="neither an array nor JSON"):
        store.commit(8, train_state={"bad": object()})
    store.commit(8)
    assert store.load_train_state() is None and list(ts_dir.iterdir()) == []


def test_resumed_run_continues_exactly(tmp_path):
    """Four steps in one go equal two steps, a restart from the store, and two more."""

    def run(root: Path, steps: int):
        store = mtjax.store.open(root, writable=True)
        ts = store.load_train_state()
        key, cursor = jax.random.wrap_key_data(ts["rng"]), ts["cursor"]
        for step in range(store.step + 1, store.step + 1 + steps):
            key, sub = jax.random.split(key)
            noise = np.asarray(jax.random.normal(sub, (CFG.hidden_size,)))
            master = store.read("head", "master").result()
            master["norm.weight"] = master["norm.weight"] + noise * cursor
            store.write("head", "master", master)
            cursor += 3
            store.commit(step, {"rng": np.asarray(jax.random.key_data(key)), "cursor": cursor})
        out = read_all(store), store.load_train_state(), store.step
        store.close()
        return out

    for name in ("straight", "resumed"):
        store = mtjax.store.create(tmp_path / name, CFG)
        write_all(store, values(store, 0))
        store.commit(0, {"rng": np.asarray(jax.random.key_data(jax.random.key(0))), "cursor": 1})
        store.close()
    straight = run(tmp_path / "straight", 4)
    run(tmp_path / "resumed", 2)
    resumed = run(tmp_path / "resumed", 2)
    assert straight[2] == resumed[2] == 4
    assert same(straight[0], resumed[0])
    assert straight[1]["cursor"] == resumed[1]["cursor"] == 13
    assert np.array_equal(straight[1]["rng"], resumed[1]["rng"])


@pytest.mark.parametrize("cfg", [
    CFG,
    ModelConfig(model_type="qwen2", attention_bias=True, sliding_window=8, layer_types=("full_attention", "sliding_attention"),
                num_hidden_layers=2, rope_scaling=RopeScaling("llama3", 8.0), extra_hf=(("bos_token_id", 1), ("nested", (("a", (1, 2)),)))),
    ModelConfig(model_type="gemma3_text", hidden_act="gelu_pytorch_tanh", rms_norm_offset=True, embed_scale=True,
                sandwich_norms=True, qk_norm=True, query_pre_attn_scalar=5.0, final_logit_softcapping=3.0,
                sliding_window=4, layer_types=("sliding_attention", "full_attention"), num_hidden_layers=2,
                rope_scaling=RopeScaling("linear", 8.0), local_rope_theta=50.0, local_rope_scaling=RopeScaling("linear", 2.0)),
])
def test_config_round_trips_through_the_manifest(cfg):
    assert layout.config_from_json(json.loads(json.dumps(layout.config_to_json(cfg)))) == cfg


def test_chunks_are_a_few_mib_of_whole_rows():
    assert layout.chunk_shape((152064, 8192), 2) == [1024, 8192]  # 16 MiB of bf16 rows
    assert layout.chunk_shape((64, 32), 4) == [64, 32]
    assert layout.chunk_shape((), 4) == []
    assert layout.chunk_shape((3, 50_000_000), 4) == [1, 50_000_000]


def test_multi_chunk_arrays_with_a_padded_last_chunk(tmp_path):
    """Arrays of several chunks (the last one partial, stored padded) read back exactly,
    and a flipped byte in any chunk, padding included, is caught."""
    store = mtjax.store.create(tmp_path / "s", CFG, chunk_bytes=1000)  # embed: 64 rows of 64 B bf16, 15 a chunk
    vals = values(store, 4)
    write_all(store, vals)
    store.commit(1)
    array_dir = tmp_path / "s" / layout.PARTS_DIR / "embed" / "compute.a" / "embedding"
    chunk_files = sorted(array_dir.glob("c.*"), key=lambda p: int(p.name.split(".")[1]))
    assert [p.name for p in chunk_files] == [f"c.{i}.0" for i in range(5)]  # rows 0-14, ..., 60-63 (+11 padding)
    with mtjax.store.open(tmp_path / "s") as reader:  # the default chunking: readers use the stored one
        assert same(read_all(reader), vals)
    last = chunk_files[-1]
    data = bytearray(last.read_bytes())
    assert len(data) == 15 * 64 + 4
    data[-10] ^= 0x40  # inside the padding
    last.write_bytes(bytes(data))
    with mtjax.store.open(tmp_path / "s") as reader:
        with pytest.raises(StoreError, match="embed compute tensor embedding .*checksum mismatch"):
            reader.read("embed", "compute").result()
    last.write_bytes(bytes(data[:-20]))
    with mtjax.store.open(tmp_path / "s") as reader:
        with pytest.raises(StoreError, match="embed compute tensor embedding .*expected"):
            reader.read("embed", "compute").result()
    store.close()


def test_tensorstore_reads_what_the_store_writes(filled, tmp_path):
    """Chunks are written without tensorstore, in its zarr3 format: tensorstore reads them back."""
    import tensorstore as ts

    store, vals = filled
    for (part, kind), arrays in vals.items():
        for leaf, expected in arrays.items():
            path = layout.slot_dir(tmp_path / "s", part, kind, "a") / leaf
            got = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}).result().read().result()
            assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes()


def test_reader_never_returns_bytes_of_two_steps(filled, tmp_path):
    """A reader fails once the writer has committed (it may now overwrite the reader's
    slots); refresh() moves the reader to the new step."""
    store, old = filled
    reader = mtjax.store.open(tmp_path / "s")
    assert same(read_all(reader), old)
    new = values(store, 2)
    write_all(store, new)
    assert same(read_all(reader), old)  # written but not committed: the reader is unaffected
    store.commit(2)
    with pytest.raises(StoreError, match="committed by its writer while this read ran"):
        reader.read("block.0", "master").result()
    reader.refresh()
    assert reader.step == 2 and same(read_all(reader), new)
    with pytest.raises(StoreError, match="read-only"):
        store.refresh()
    reader.close()


def test_a_write_during_a_commit_is_refused(tmp_path):
    """A write issued while `commit` runs could land in a slot the commit names or frees."""
    store = mtjax.store.create(tmp_path / "s", CFG)
    arrays = {leaf: np.zeros(s.shape, s.dtype) for leaf, s in store.schema("block.0", "master").items()}
    refused = []

    def write_now(committing, phase, generation):
        if phase == "written":
            with pytest.raises(mtjax.store.StoreError, match="while a commit ran"):
                store.write("block.0", "master", arrays)
            refused.append(phase)

    stop = commit.observe(write_now)
    try:
        store.commit(1)
    finally:
        stop()
    assert refused == ["written"]
    store.write("block.0", "master", arrays).result()  # after the commit: accepted
    store.close()
