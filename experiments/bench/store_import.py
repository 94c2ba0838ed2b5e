"""Peak host memory of `mtjax import` on a generated checkpoint of more than 2 GB.

    .venv/bin/python experiments/bench/store_import.py [--layers 8] [--dir /tmp] [--no-doc]

Writes a random fp32 Llama checkpoint (d_model 2048, 8 blocks: 2.2 GB in 5 safetensors
shards) with numpy and safetensors directly, then runs `python -m mtjax import` on it in
a subprocess and reports that process's peak RSS (its VmHWM) next to the
checkpoint size and the largest part's state. A second subprocess that only imports the
same modules gives the interpreter + JAX baseline. The table goes to stdout and to this
script's section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import harness  # first: the checkout on sys.path, JAX on the CPU

import numpy as np
from safetensors.numpy import save_file

from mtjax import hf, parts
from mtjax.model_config import ModelConfig, to_hf_dict
from mtjax.optim import OptimConfig, make_optimizer

SECTION = "store-import"
SHARD_BYTES = 500 * 10**6


def generate(cfg: ModelConfig, out: Path) -> tuple[int, int]:
    """A sharded fp32 checkpoint of random weights, one shard in memory at a time.

    Returns (bytes on disk, number of shards)."""
    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    shard_of: dict[str, int] = {}
    current: dict[str, np.ndarray] = {}

    def flush():
        save_file(current, str(out / f"shard-{len(set(shard_of.values())):05d}.tmp"), metadata={"format": "pt"})
        shard_of.update({name: len(set(shard_of.values())) for name in current})
        current.clear()

    for spec in hf.layout(cfg):
        if current and sum(a.nbytes for a in current.values()) + 4 * np.prod(spec.shape) > SHARD_BYTES:
            flush()
        current[spec.hf_name] = (rng.random(spec.shape, np.float32) - 0.5) * 0.04
    flush()
    n = len(set(shard_of.values()))
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for i, name in enumerate(names):
        (out / f"shard-{i:05d}.tmp").rename(out / name)
    index = {"metadata": {}, "weight_map": {t: names[i] for t, i in shard_of.items()}}
    (out / hf.INDEX_FILE).write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(to_hf_dict(cfg), indent=1))
    return sum(f.stat().st_size for f in out.glob("*.safetensors")), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="blocks of the d_model 2048 Llama (205 MB each in fp32)")
    ap.add_argument("--dir", default=None, help="where to put the checkpoint and the store (default: a temp dir)")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()

    cfg = harness.llama(args.layers, 2048, vocab=32000, ffn=5632, head_dim=128, rms_norm_eps=1e-5)
    tx = make_optimizer(OptimConfig())
    state = {p.name: sum(parts.nbytes(parts.schema(cfg, p.name, k, tx)) for k in ("master", "opt"))
             + parts.nbytes(parts.schema(cfg, p.name, "master")) // 2 for p in parts.parts(cfg)}  # + bf16 compute
    largest = max(state, key=state.get)
    base = Path(tempfile.mkdtemp(prefix="bench-import-", dir=args.dir))
    try:
        t = time.perf_counter()
        ckpt_bytes, shards = generate(cfg, base / "ckpt")
        print(f"generated {ckpt_bytes / 1e9:.2f} GB checkpoint in {time.perf_counter() - t:.0f} s at {base / 'ckpt'}")
        baseline, _ = harness.peak_rss_of(["-c", "import jax.numpy as jnp, mtjax.store.hf_import; "
                                                  "jnp.zeros(8).block_until_ready()"])
        rss, secs = harness.peak_rss_of(["-m", "mtjax", "import", str(base / "ckpt"), str(base / "store")])
        store_bytes = sum(f.stat().st_size for f in (base / "store").rglob("*") if f.is_file())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    gb = 1e9
    table = (
        "| quantity | GB |\n|---|---|\n"
        f"| checkpoint (fp32 safetensors, {shards} shards) | {ckpt_bytes / gb:.2f} |\n"
        f"| store written (bf16 compute + fp32 master + AdamW mu, nu) | {store_bytes / gb:.2f} |\n"
        f"| largest part's state ({largest}: master + compute + opt) | {state[largest] / gb:.2f} |\n"
        f"| peak RSS of `mtjax import` | {rss / gb:.2f} |\n"
        f"| peak RSS of the interpreter + JAX + mtjax alone | {baseline / gb:.2f} |\n"
    )
    harness.publish(SECTION, "Layer store import memory (experiments/bench/store_import.py)", (
        f"`mtjax import` of a generated random fp32 Llama checkpoint (d_model 2048, {args.layers} blocks, "
        f"vocab 32000), peak RSS (VmHWM) of the import process; import took {secs:.0f} s on a shared machine.\n\n"
        + table), f"experiments/bench/store_import.py --layers {args.layers}", write=not args.no_doc)


if __name__ == "__main__":
    main()
