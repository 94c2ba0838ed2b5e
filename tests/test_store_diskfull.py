"""A full disk during writes and during a commit: one StoreError, the committed step intact.

The store lives on a small tmpfs mounted for the test (this needs root, as on the
project machines; elsewhere the test is skipped with the reason shown).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import mtjax.store
from mtjax.store.errors import StoreError
import small_disk
from test_store import read_all, same, values, write_all
from test_store_crash import TINY

pytestmark = pytest.mark.slow  # mounts small tmpfs disks and fills them


@pytest.fixture
def disk(tmp_path):
    with small_disk.mounted(tmp_path / "disk", "4m") as mnt:
        yield mnt


fill_disk = small_disk.fill


def committed(root: Path, step: int, seed: int) -> None:
    with mtjax.store.open(root) as reader:  # readers need no lock, so this works beside the writer
        assert reader.step == step
        assert same(read_all(reader), values(reader, seed))
        assert reader.load_train_state() == {"step": step}


def at_step_1(root: Path) -> mtjax.store.Store:
    """A new store of TINY at `root`, its step 1 (seed 1's values) committed."""
    store = mtjax.store.create(root, TINY)
    write_all(store, values(store, 1))
    store.commit(1, {"step": 1})
    return store


def test_disk_full_while_writing(disk):
    root = disk / "s"
    store = at_step_1(root)
    fill_disk(disk, leave=32 << 10)  # some chunks fit, then the disk is full
    errors = []
    for (part, kind), arrays in values(store, 2).items():
        try:  # creating a new array fails at once; writing chunks fails in the future
            future = store.write(part, kind, arrays)
        except StoreError as e:
            errors.append(e)
        else:
            errors.append(future.exception())
    failed = [e for e in errors if e is not None]
    assert failed and all(isinstance(e, StoreError) and "committed step 1 is intact" in str(e) for e in failed)
    assert any("No space left" in str(e) for e in failed)
    with pytest.raises(StoreError, match="reopen store"):
        store.commit(2, {"step": 2})
    committed(root, 1, 1)
    store.close()
    committed(root, 1, 1)


def test_disk_full_during_commit_then_retry(disk):
    root = disk / "s"
    store = at_step_1(root)
    write_all(store, values(store, 2))  # every array is written; only the commit lacks space
    ballast = fill_disk(disk)
    with pytest.raises(StoreError, match="previous commit is intact"):
        store.commit(2, {"step": 2})  # the train state cannot be saved
    committed(root, 1, 1)
    with pytest.raises(StoreError, match="previous commit is intact"):
        store.commit(2, {"step": 2})  # the train state cannot be saved
    ballast.unlink()  # space freed: the same writes commit now
    store.commit(2, {"step": 2})
    committed(root, 2, 2)
    store.close()
    committed(root, 2, 2)


def test_disk_full_when_writing_the_manifest(disk):
    root = disk / "s"
    store = at_step_1(root)
    write_all(store, values(store, 2))
    ballast = fill_disk(disk)
    with pytest.raises(StoreError, match="manifest.json.*previous commit is intact"):
        store.commit(2)  # no train state: the manifest itself is what does not fit
    assert not (root / "manifest.json.tmp").exists()
    committed(root, 1, 1)
    ballast.unlink()
    store.commit(2, {"step": 2})
    committed(root, 2, 2)
    store.close()


def test_import_onto_a_full_disk_names_the_destination(disk, tmp_path, capsys):
    """`mtjax import` that runs out of space names the store directory the user gave and
    says to free space; neither the store nor its staging directory is left behind."""
    import hf_models
    from mtjax import cli

    ckpt, _ = hf_models.checkpoint(tmp_path, "qwen2", hidden_size=64, intermediate_size=128,
                                   num_attention_heads=2, num_key_value_heads=1)
    small_disk.fill(disk, leave=256 << 10)  # the embedding fits, a block does not
    capsys.readouterr()  # transformers' own progress while saving the checkpoint
    assert cli.main(["import", str(ckpt), str(disk / "store")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"mtjax import: error: cannot write the store at {disk / 'store'}: No space left on device; "
                   "free space on that disk or choose another location; nothing was created there")
    assert sorted(p.name for p in disk.iterdir()) == ["ballast"]
