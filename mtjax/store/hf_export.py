"""`mtjax export`: a store's committed master weights as a Hugging Face checkpoint.

Tensors are produced one part at a time in the checkpoint's own dtype and names
(mtjax.hf's table) and written by mtjax.hf.save_checkpoint, which holds one shard; the
tokenizer files of the store's model go beside them. A byte-level model has none
(transformers' AutoTokenizer would load an unrelated or empty one without a word): its
export gets a README.md that says so and how to encode and decode, and the export
says it in one line.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from safetensors import SafetensorError

from mtjax import hf, lora
from mtjax.data import tokenizer as toklib
from mtjax.store import adapters
from mtjax.store import store as store_mod
from mtjax.store import tokenizer
from mtjax.store.errors import StoreError
from mtjax.store.hf_import import by_part, leaf_names

CARD_FILE = "README.md"  # a byte-level export's note (a model card: transformers reads nothing from it)


def _weights(store, masters: dict | None, part: str) -> dict:
    # Waits: one part in memory at a time.
    return store_mod.weights(store, part) if masters is None else masters[part]


def hf_tensors(store, masters: dict | None = None, merge: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """(hf name, array) in checkpoint order, cast to the config's param dtype: of the
    store's master weights, or of `masters` ({part: {leaf: array}}, whole) when given;
    with `merge`, LoRA adapters folded into their kernels (mtjax.lora.merged)."""
    cfg = store.config
    dtype = hf.NP_DTYPES[cfg.param_dtype]
    grouped = by_part(hf.layout(cfg))
    for part in store.parts:
        master = _weights(store, masters, part)
        master = lora.merged(cfg, master) if merge else master
        for spec in grouped[part]:
            yield spec.hf_name, hf.to_hf(spec, [master[leaf] for leaf in leaf_names(spec)]).astype(dtype)
        del master


def _write_tokenizer(source: Path | None, out: Path) -> None:
    """The store's tokenizer files (a directory of them, or one tokenizer.json, gzipped or not)."""
    if source is None:
        return
    if source.is_dir():
        toklib.copy_hf_files(source, out)
        return
    raw = source.read_bytes()
    (out / toklib.TOKENIZER_FILE).write_bytes(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def byte_level_line(out: Path) -> str:
    """What the export of a byte-level model says, in one line."""
    eos = toklib.ByteTokenizer.eos_id
    return (f"{out} has no tokenizer: the model is byte-level (token ids are the UTF-8 bytes of the text, "
            f"{eos} is EOS); encode with list(text.encode()), decode with bytes(ids), or "
            f"`mtjax generate {out} --tokenizer bytes` (see {out / CARD_FILE})")


def _byte_level_card(out: Path) -> str:
    eos = toklib.ByteTokenizer.eos_id
    return f"""# A byte-level model, trained with mtjax

This checkpoint has no tokenizer files: the model reads and writes bytes. Token id
0-255 is that byte of the text's UTF-8 encoding and id {eos} ends a document (EOS);
there is no BOS. `AutoTokenizer.from_pretrained` on this directory does not give these
ids; encode and decode by hand:

```python
import torch, transformers

model = transformers.AutoModelForCausalLM.from_pretrained("{out}")
ids = torch.tensor([list("In the beginning".encode("utf-8"))])
out = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id={eos})
print(bytes(t for t in out[0].tolist() if t < 256).decode("utf-8", errors="replace"))
```

or sample with mtjax: `mtjax generate {out} --tokenizer bytes --prompt "In the beginning"`.
"""


def export_hf(store_dir: str | Path, out_dir: str | Path, max_shard_bytes: int = 5 * 10**9, replace: bool = False,
              extra: Callable[[Path], None] | None = None, masters: dict | None = None,
              say: Callable[[str], None] | None = None, merge: bool = False) -> Path:
    """Write the store's committed master weights, and its model's tokenizer (see
    mtjax.store.tokenizer; none for a byte-level one), as a checkpoint at `out_dir`; a
    store with LoRA adapters (mtjax.lora) as a PEFT adapter directory
    (mtjax.store.adapters), or with `merge` as the merged model's checkpoint.

    `out_dir` must not exist or be empty, unless `replace` (a run's final/ export, which a
    longer resumed run writes again). `extra(dir)` adds files (a run's tokenizer) to the
    checkpoint before it is put in place. `masters`: the whole master weights by part, to
    write instead of the store's (a multi-process run's shard holds only its rows).
    `say(line)`: told, once the export is in place, that a byte-level model's has no tokenizer.
    """
    out = Path(out_dir)
    if not replace and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StoreError(f"{out} already exists and is not empty; choose a new output directory")
    # Written in a hidden sibling and renamed into place: an export killed at any moment
    # leaves no partial checkpoint under `out`, and rerunning it starts afresh. A failed
    # one (a full disk) removes its sibling and leaves `out` as it was.
    tmp, old = out.with_name(f".{out.name}.export-tmp"), out.with_name(f".{out.name}.export-old")
    store_mod.remove(tmp)
    if old.exists() and not out.exists():
        old.rename(out)  # a replacing export was killed between its two renames
    store_mod.remove(old)
    with store_mod.open(store_dir) as store:
        if merge and store.config.lora is None:
            raise StoreError(f"--merge folds LoRA adapters into the base model, and store {store_dir} has none; "
                             "export it without --merge")
        store.check_complete("export it")
        if store.shard is not None and masters is None:
            raise StoreError(f"store {store_dir} is one shard of a multi-process run's store (its rows of the master "
                             "weights only); export the run's final/ checkpoint instead, which holds the whole model")
        try:
            if store.config.lora is not None and not merge:  # the adapters alone, as PEFT saves them
                tmp.mkdir()
                adapters.write(store.config, lambda part: _weights(store, masters, part), tmp)
            else:
                hf.save_checkpoint(store.config, hf_tensors(store, masters, merge), tmp, max_shard_bytes)
            _write_tokenizer(tokenizer.export_source(store), tmp)
            byte_level = tokenizer.trained_spec(store) == toklib.ByteTokenizer.spec
            if byte_level:
                (tmp / CARD_FILE).write_text(_byte_level_card(out))
            if extra is not None:
                extra(tmp)
            if out.exists() and replace:
                out.rename(old)
            elif out.exists():
                out.rmdir()  # checked empty above
            tmp.rename(out)
            store_mod.remove(old)
        except BaseException as e:
            store_mod.remove(tmp)
            if old.exists() and not out.exists():
                old.rename(out)
            # hf.save_checkpoint reports safetensors' own write errors as CheckpointError.
            if isinstance(e, (OSError, SafetensorError, hf.CheckpointError)):
                full = any(s in str(e) for s in ("StorageFull", "No space left"))
                reason = "No space left on device" if full else getattr(e, "strerror", None) or e
                raise StoreError(f"cannot write the checkpoint to {out} ({reason}); nothing was left behind: free "
                                 f"disk space, then export {store_dir} again (`mtjax export`)") from None
            raise
    if byte_level and say is not None:
        say(byte_level_line(out))
    return out
