"""Measure this machine into a `HardwareProfile` (source "measured").

Each figure is measured the way the streaming engine uses the resource:

    disk     the store's pattern: chunk files (16 MiB) written with their writeback
             started, all fsynced at the end as a commit does (mtjax.store.durable), then read
             cold (page cache dropped with posix_fadvise DONTNEED) into pre-touched
             buffers, on the store's number of I/O threads
    memory   copies between pre-touched buffers on every core (fresh buffers would
             measure page faults, not bandwidth); reported as bytes read + written
    matmul   a jitted square matmul, fp32 and bf16 (fp32 accumulation)
    link     device_put to and from the first non-CPU device, when there is one
    block    the engine's compiled forward + recompute + backward of a Llama block: its
             FLOP/s over the fp32 matmul's is `compute_efficiency`; `calibrate` redoes it
             on a block of the model being planned

`quick=True` uses small sizes (tests); its figures are rough.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import psutil

from mtjax import model, moe, partid, parts
from mtjax.model_config import ModelConfig
from mtjax.plan.cost import block_forward_flops
from mtjax.plan.hardware import HardwareProfile
from mtjax.store import durable
from mtjax.store.layout import CHUNK_BYTES
from mtjax.store.io import IO_THREADS
from mtjax.stream.blockfns import block_fns


def _timings(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _best_of(fn, repeats: int) -> float:
    """Shortest of `repeats` timings: the least disturbed by other processes (a rate's peak)."""
    return min(_timings(fn, repeats))


def disk_bandwidth(directory: str | Path, nbytes: int) -> tuple[float, float, bool]:
    """(read bytes/s, write bytes/s, whether the read was cold) of chunk files in `directory`,
    written and read the way the layer store does (mtjax.store.chunks)."""
    size = min(CHUNK_BYTES, nbytes)
    count = max(1, nbytes // size)
    cold = hasattr(os, "posix_fadvise")
    root = Path(tempfile.mkdtemp(prefix="mtjax-probe-", dir=directory))
    bufs = [np.ones(size, np.uint8) for _ in range(IO_THREADS)]  # pre-touched: time the disk, not page faults
    paths = [root / f"chunk{i}" for i in range(count)]
    writeback = durable.Writeback()

    def write(i):
        fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, bufs[i % IO_THREADS])
        finally:
            os.close(fd)
        writeback.start(paths[i])

    def read(i):
        fd = os.open(paths[i], os.O_RDONLY)
        try:
            if cold:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop it from the page cache
            return os.readv(fd, [memoryview(bufs[i % IO_THREADS])])
        finally:
            os.close(fd)

    try:
        with concurrent.futures.ThreadPoolExecutor(IO_THREADS) as pool:
            t0 = time.perf_counter()
            list(pool.map(write, range(count)))
            durable.sync(pool, paths, [root])  # written when on disk, as a commit makes them
            write_rate = count * size / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            total = sum(pool.map(read, range(count)))
            read_rate = total / (time.perf_counter() - t0)
    finally:
        writeback.close()
        shutil.rmtree(root, ignore_errors=True)
    return read_rate, write_rate, cold


def memory_bandwidth(nbytes: int, repeats: int = 3) -> float:
    """Bytes moved (read + written) per second by copies on all cores."""
    workers = os.cpu_count() or 1
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)  # both touched
    bounds = np.linspace(0, nbytes, workers + 1, dtype=np.int64)
    pieces = [(dst[a:b], src[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # np.copyto releases the GIL
        def copy():
            list(pool.map(lambda p: np.copyto(*p), pieces))
        copy()
        return 2 * nbytes / _best_of(copy, repeats)


def matmul_flops(n: int, dtype: str, repeats: int = 3) -> float:
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    f(a, a).block_until_ready()  # compile outside the timing
    return 2 * n**3 / _best_of(lambda: f(a, a).block_until_ready(), repeats)


def block_flops(cfg, batch: int, seq: int, repeats: int = 5) -> float:
    """Executed FLOP/s of one block of `cfg` in the engine's own compiled programs: the
    forward, then recompute + backward (4 forward-equivalents, as the cost model counts).

    The median of `repeats` timings, not the best: a training step is disturbed by the
    machine's other work as often as the probe is, and on the shared 2-core machine the
    best of three ran 1.2-1.5x faster than the steps it was meant to price."""
    spec = cfg.layer_specs[0]
    name = partid.block(0)
    rng = np.random.default_rng(0)
    schema = parts.schema(cfg, name, "compute")
    w = {k: jnp.asarray(rng.normal(0, 0.02, v.shape).astype(v.dtype)) for k, v in schema.items()}
    x = jnp.asarray(rng.normal(size=(batch, seq, cfg.hidden_size)).astype(cfg.compute_dtype))
    fns = block_fns(cfg)

    def fwd_bwd():
        jax.block_until_ready(fns.grad[spec](w, x, *fns.forward[spec](w, x)))  # the outputs as cotangents

    fwd_bwd()  # compile outside the timing
    n = sum(math.prod(v.shape) for v in schema.values()) - model.inactive_params(cfg, spec)
    flops = block_forward_flops(cfg, spec, n, batch, seq, dispatch=moe.dispatch(jax.default_backend()))
    return 4 * flops / statistics.median(_timings(fwd_bwd, repeats))


def calibrate(profile: HardwareProfile, cfg, batch: int, seq: int, achieved: float | None = None) -> HardwareProfile:
    """`profile` with compute_efficiency measured on one block of `cfg` at this batch and
    sequence length (block FLOP/s over square-matmul FLOP/s in the compute dtype).
    `achieved`: that block's FLOP/s measured before (default: `block_flops` now)."""
    achieved = block_flops(cfg, batch, seq) if achieved is None else achieved
    efficiency = min(1.0, achieved / profile.matmul_flops(cfg.compute_dtype) * profile.compute_efficiency)
    return dataclasses.replace(profile, compute_efficiency=efficiency,
                               notes=profile.notes + f"; compute calibrated on a block of width {cfg.hidden_size}, "
                                     f"batch {batch} x seq {seq}: {achieved / 1e9:.0f} GFLOP/s")


def link_bandwidth(nbytes: int, repeats: int = 3) -> tuple[float | None, float | None, int | None]:
    """(host->device, device->host bytes/s, device memory bytes); Nones on a CPU-only JAX."""
    devices = [d for d in jax.devices() if d.platform != "cpu"]
    if not devices:
        return None, None, None
    dev = devices[0]
    host = np.ones(nbytes // 4, np.float32)
    on_dev = jax.device_put(host, dev)
    on_dev.block_until_ready()
    h2d = nbytes / _best_of(lambda: jax.device_put(host, dev).block_until_ready(), repeats)
    d2h = nbytes / _best_of(lambda: np.asarray(jax.device_get(on_dev)), repeats)
    try:  # the engine stages through pinned host memory where the backend has it
        pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        to_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
        staged = jax.device_put(host, pinned)
        staged.block_until_ready()
        h2d = max(h2d, nbytes / _best_of(lambda: jax.device_put(staged, to_dev).block_until_ready(), repeats))
        d2h = max(d2h, nbytes / _best_of(lambda: jax.device_put(on_dev, pinned).block_until_ready(), repeats))
    except Exception:  # noqa: BLE001 - no pinned memory kind: the plain figures stand
        pass
    stats = dev.memory_stats() or {}
    return h2d, d2h, stats.get("bytes_limit")


def _probe_block(width: int):
    heads = width // 64
    return ModelConfig(vocab_size=256, hidden_size=width, intermediate_size=int(width * 2.75), num_hidden_layers=1,
                       num_attention_heads=heads, num_key_value_heads=heads, head_dim=64, compute_dtype="float32")


# A fresh training process before any state: the runtime, the fused update's compiled
# loops and a tiny engine's programs (the probe's own process holds its big buffers' heap).
# Its steps, whose compute is negligible, time the engine's fixed cost per part streamed.
_RUNTIME_SCRIPT = """
import statistics, time
import numpy as np, psutil
from mtjax.model_config import ModelConfig
from mtjax import model
from mtjax.stream import StreamEngine
cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16, compute_dtype="bfloat16")
engine = StreamEngine(cfg, model.init_params(cfg, seed=0))
tokens = np.zeros((1, 2, 16), np.int32)
times = []
for i in range(6):
    t0 = time.perf_counter()
    engine.step(tokens)
    times.append(time.perf_counter() - t0)
parts = len(engine.schedule.transfers)  # the parts one step streams
engine.close()
print(psutil.Process().memory_info().rss, statistics.median(times[1:]) / parts)
"""


def runtime() -> tuple[int, float]:
    """(host RAM a training process holds before its state, fixed seconds per part
    streamed), from a tiny engine in a fresh subprocess on the CPU backend."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _RUNTIME_SCRIPT], capture_output=True, text=True, env=env, check=True)
    rss, per_part = out.stdout.strip().splitlines()[-1].split()
    return int(rss), float(per_part)


def run(directory: str | Path = ".", quick: bool = False, name: str | None = None) -> HardwareProfile:
    """Measure this machine. Full mode moves ~1 GiB through disk and memory."""
    size = (64 << 20) if quick else (1 << 30)
    read, write, cold = disk_bandwidth(directory, size)
    mem = memory_bandwidth(size // 2)
    # Quick: 512, not smaller. compute_dtype=auto compares the two rates (mtjax.plan.compute_dtype);
    # at 256 their ratio on AMD Zen 4 ranged 1.22-1.72 between calls, at 512 1.84-2.14 (~0.05 s).
    n = 512 if quick else 2048
    fp32, bf16 = matmul_flops(n, "float32"), matmul_flops(n, "bfloat16")
    h2d, d2h, dev_mem = link_bandwidth(size // 2)
    # A Llama block of width 1024 at seq 512, fwd + recompute + bwd (the cpu-2core profile's
    # reference block); quick: a small one.
    block = _probe_block(256 if quick else 1024)
    efficiency = min(1.0, block_flops(block, 1, 128 if quick else 512) / fp32)
    ram = psutil.virtual_memory().total
    runtime_bytes, part_overhead = runtime()
    on_host = h2d is None
    device = jax.devices()[0].device_kind if not on_host else f"{platform.processor() or platform.machine()} CPU"
    notes = f"measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()}, {os.cpu_count()} cores"
    notes += "" if cold else "; disk read may be warm (no posix_fadvise)"
    notes += "; quick mode: small sizes, rough figures" if quick else ""
    return HardwareProfile(
        name=name or f"measured-{platform.node()}", source="measured", device=device,
        device_memory_bytes=int(dev_mem or ram), matmul_flops_fp32=fp32, matmul_flops_bf16=bf16,
        # A transformer block's mix of matmuls, attention and elementwise work, measured.
        compute_efficiency=efficiency, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
        host_memory_bytes_per_s=mem, host_ram_bytes=ram, disk_read_bytes_per_s=read,
        disk_write_bytes_per_s=write, disk_bytes=shutil.disk_usage(directory).free,
        device_is_host=on_host, notes=notes,
        runtime_bytes=runtime_bytes, part_overhead_s=part_overhead, devices=len(jax.local_devices()),
    )
