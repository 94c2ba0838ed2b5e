"""The optimizer stage: one part's AdamW update on host-resident state.

The update reads the fp32 master weights, the optimizer state and the gradient, and
writes master, optimizer state and, where one is kept, the compute copy (DESIGN-NOTES
point 4). mtjax's own AdamW (an OptimConfig) runs as the fused loop of
mtjax.stream.fused_adamw: one pass over memory, in place on RAM-tier state.

Any other optax transformation (or mtjax's without numba) runs as a jitted program on
the CPU backend. XLA compiles it to about four passes over memory (46 bytes/param where
one pass would move 30), so it runs the same program once per cache-sized row chunk of
each leaf: the four passes then hit cache, and memory sees about one.

The RAM tier keeps master weights and optimizer state as `RowChunks`: one XLA buffer per
chunk, donated to the chunk's program, so the update runs in place. The compute copy
stays one array per leaf (the forward streams it): each chunk's program also writes its
rows of it (an update-slice of the donated leaf, in place). All chunk programs are
dispatched without a host sync. Arrays made elsewhere (the first update) are read
through zero-copy views. Disk-tier state (numpy buffers the engine reuses) keeps the
whole-part program: chunk results would need new whole arrays, paying the page faults
that chunking saves.

Chunking is exact only for transformations that are elementwise per leaf (AdamW is):
mtjax.stream.elementwise decides that from the traced program. Any other transformation
runs as one whole-part program with donated buffers. Every part gets the same clip
scale, computed from the global gradient norm before any part is updated.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtjax import model, parts, treepath
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.stream import fused_adamw
from mtjax.stream.elementwise import leafwise
from mtjax.hostmem import huge_empty
from mtjax.stream.tiers import host_device

# fp32 bytes of one leaf per chunk program. Measured (experiments/bench/optimizer.py): 8-32 MiB
# beat 4 MiB unless the machine is busy; 1 MiB pays more in dispatch than it saves.
CHUNK_BYTES = 16 << 20


def _update(tx, compute_dtype, master, opt_state, compute, grads, scale):
    del compute  # donated: its buffer receives the new compute copy
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) * scale, grads)
    updates, opt_state = tx.update(grads, opt_state, master)
    master = optax.apply_updates(master, updates)
    return master, opt_state, jax.tree.map(lambda w: w.astype(compute_dtype), master)


def _update_rows(tx, compute_dtype, master, opt_state, compute, starts, grads, scale):
    """`_update` on row chunks of leaves; each chunk's compute copy is written into its
    leaf's whole compute copy (donated, so in place)."""
    master, opt_state, chunks = _update(tx, compute_dtype, master, opt_state, None, grads, scale)
    return master, opt_state, {n: _put_rows(compute[n], c, starts[n]) for n, c in chunks.items()}


def _put_rows(whole, rows, start):
    """`whole` with `rows` written from row `start` on (the whole leaf: `rows` itself)."""
    if whole.shape == rows.shape:
        return rows
    # As raw words: XLA's CPU backend widens a bf16 update-slice to fp32 over the whole
    # array (a full pass per chunk); on integers it writes only the chunk, in place.
    word = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[whole.dtype.itemsize]
    bits = jax.lax.dynamic_update_slice(jax.lax.bitcast_convert_type(whole, word),
                                        jax.lax.bitcast_convert_type(rows, word), (start,) + (0,) * (whole.ndim - 1))
    return jax.lax.bitcast_convert_type(bits, whole.dtype)


class RowChunks:
    """One leaf of host state held as row chunks (XLA buffers on the CPU backend).

    The chunks are what the optimizer donates and updates in place. Everything else
    sees an array: `np.asarray` joins the chunks (a copy), `block_until_ready` waits.
    """

    def __init__(self, chunks: list, rows: tuple):
        self.chunks, self.rows = chunks, rows  # rows: the (start, stop) of each chunk, or () for one whole chunk
        first = chunks[0]
        self.dtype = np.dtype(first.dtype)
        self.shape = (rows[-1][1], *first.shape[1:]) if rows else tuple(first.shape)

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: math.prod(self.shape))
    nbytes = property(lambda self: self.size * self.dtype.itemsize)

    def __array__(self, dtype=None, copy=None):
        out = np.empty(self.shape, self.dtype)
        for chunk, where in zip(self.chunks, _slices(self.rows)):
            out[where] = np.asarray(chunk)
        return out if dtype is None else out.astype(dtype)

    def block_until_ready(self):
        jax.block_until_ready(self.chunks)
        return self

    def __repr__(self):
        return f"RowChunks(shape={self.shape}, dtype={self.dtype}, chunks={len(self.chunks)})"


def _slices(rows: tuple) -> list:
    return [slice(a, b) for a, b in rows] if rows else [...]


@dataclasses.dataclass(frozen=True)
class LeafSplit:
    """How a part's flat optimizer state divides among its parameter leaves."""

    own: dict[str, tuple[str, ...]]  # param leaf -> its state leaves (same shape as it)
    shared: tuple[str, ...]  # rank-0 state leaves every leaf's update reads (step counts)


def leaf_split(tx, compute_dtype, master: dict) -> LeafSplit | None:
    """The split of `tx`'s state over the leaves of `master` (abstract), or None when
    `tx` is not elementwise per leaf (then only whole-part updates are exact)."""
    names = {n: set(treepath.flatten(jax.eval_shape(tx.init, {n: s}))) for n, s in master.items()}
    whole = treepath.flatten(jax.eval_shape(tx.init, master))
    try:  # state that exists without any parameter: step counts and the like
        shared = set(treepath.flatten(jax.eval_shape(tx.init, {})))
    except Exception:  # noqa: BLE001 (a transformation that cannot init nothing is not chunked)
        return None
    own = {n: tuple(sorted(got - shared)) for n, got in names.items()}
    label = {o: n for n, os in own.items() for o in os}
    if (set(label) | shared != set(whole) or len(label) != sum(map(len, own.values()))
            or any(whole[o].shape != master[label[o]].shape for o in label) or any(whole[o].shape for o in shared)):
        return None
    opt = jax.eval_shape(tx.init, master)
    opt_labels = treepath.unflatten(opt, {o: label.get(o, "") for o in whole})
    leaf_labels = {n: n for n in master}
    scalar = jax.ShapeDtypeStruct((), jnp.float32)
    fn = functools.partial(_update, tx, compute_dtype)
    ok = leafwise(fn, (master, opt, None, master, scalar), (leaf_labels, opt_labels, None, leaf_labels, ""),
                  (leaf_labels, opt_labels, leaf_labels))
    return LeafSplit(own, tuple(sorted(shared))) if ok else None


def _chunk_rows(shape: tuple, chunk_elems: int) -> int:
    """Rows (along axis 0) per chunk: about `chunk_elems` elements, and a multiple of
    whatever keeps every chunk 64-byte aligned in bf16 (so views alias, not copy)."""
    row = math.prod(shape[1:])
    step = 32 // math.gcd(row, 32)
    rows = max(1, chunk_elems // row)
    return rows - rows % step if rows >= step else rows


def _plan(master: dict, chunk_elems: int) -> tuple[list[tuple[str, ...]], dict[str, tuple]]:
    """(chunk programs, rows of each leaf): one program for all small leaves whole, then
    one per row chunk of each large leaf. A program is a tuple of (leaf, chunk index)."""
    rows, small = {}, []
    for n, s in master.items():
        shape = tuple(s.shape)
        if math.prod(shape) <= chunk_elems:
            rows[n] = ()
            small.append((n, 0))
        else:
            step = _chunk_rows(shape, chunk_elems)
            rows[n] = tuple((a, min(a + step, shape[0])) for a in range(0, shape[0], step))
    calls = [tuple(small)] if small else []
    calls += [((n, k),) for n, r in rows.items() for k in range(len(r))]
    return calls, rows


def _plain(arrays: dict) -> dict:
    return {n: np.asarray(a) if isinstance(a, RowChunks) else a for n, a in arrays.items()}


class PartUpdate:
    """AdamW (any optax transformation) applied one part at a time on the host.

    With `optim` (mtjax's own AdamW) and numba installed, the update is the one-pass
    loop of mtjax.stream.fused_adamw: it runs when called, in place on the kinds named in
    `own` (numpy arrays it made before), into new arrays otherwise. Without, it is the
    optax program on the CPU backend, dispatched asynchronously: inputs are consumed, as
    if donated; RAM-tier state comes back as `RowChunks`, which the next update runs on
    in place; parts whose state arrives as numpy buffers (disk tier) run the whole-part
    program, which only reads them.
    """

    def __init__(self, cfg: ModelConfig, tx: optax.GradientTransformation, chunk_bytes: int | None = CHUNK_BYTES,
                 optim: OptimConfig | None = None):
        self.cfg, self.tx = cfg, tx
        self.fused = _fused_for(cfg, tx, optim)  # None: the optax program
        self.cpu = host_device()
        self.dtype = np.dtype(cfg.compute_dtype)
        self.chunk_elems = None if chunk_bytes is None else max(1, chunk_bytes // 4)  # None: whole parts only
        # keep_unused: jit drops an unread `compute` argument otherwise, and with it the
        # donation, so every update would page-fault a fresh compute-copy buffer.
        self._update = jax.jit(functools.partial(_update, tx, self.dtype), donate_argnums=(0, 1, 2), keep_unused=True)
        self._chunk = jax.jit(functools.partial(_update_rows, tx, self.dtype), donate_argnums=(0, 1, 2),
                              keep_unused=True)  # a whole leaf's compute copy is unread (replaced) but donated
        self._init = jax.jit(tx.init)
        self._convert = jax.jit(lambda tree: jax.tree.map(lambda w: w.astype(self.dtype), tree))
        self._splits: dict[tuple, LeafSplit | None] = {}
        self._plans: dict[tuple, tuple] = {}
        self._chunk_templates: dict[tuple, object] = {}

    def init_state(self, master: dict) -> dict:
        """Flat optimizer state of one part from its flat fp32 master weights."""
        return treepath.flatten(self._init(jax.device_put(_plain(master), self.cpu)))

    def compute_copy(self, master: dict) -> dict:
        """The compute-dtype copy of flat master weights, in XLA buffers the update can donate."""
        return self._convert(jax.device_put(_plain(master), self.cpu))

    def split(self, master: dict) -> LeafSplit | None:
        """How this part's update divides among its leaves (None: whole-part program only)."""
        key = tuple((n, tuple(np.shape(a))) for n, a in master.items())
        if key not in self._splits:
            abstract = {n: jax.ShapeDtypeStruct(s, np.float32) for n, s in key}
            self._splits[key] = leaf_split(self.tx, self.dtype, abstract)
        return self._splits[key]

    def __call__(self, part: str, master: dict, opt: dict, compute: dict | None, grads: dict, scale,
                 own: Collection[str] = (), copy: bool = True):
        """(master, opt, compute) of `part` after one update; all flat dicts on the host.

        `own`: the kinds ("master", "opt", "compute") whose arrays the fused update may
        overwrite when they are its own earlier results (the RAM tier's). `copy=False`
        (fused only): no compute copy is written, and None is returned for it.
        """
        if self.fused is not None:
            return self._fused(master, opt, compute or {}, grads, scale, own, copy)
        # Disk-tier state arrives as numpy buffers the engine reuses: chunk results would
        # need new whole arrays anyway, so those parts keep the one-program update.
        on_disk = any(isinstance(a, np.ndarray) for a in (*master.values(), *opt.values()))
        split = None if on_disk or not self.chunk_elems else self.split(master)
        if split is None:
            return self._whole(master, opt, compute, grads, scale)
        return self._chunked(split, master, opt, compute or {}, grads, scale)

    def _whole(self, master, opt, compute, grads, scale):
        # Arrays read from disk arrive as numpy: place them on the CPU backend, not the
        # default (accelerator) device.
        master, opt, compute, grads = jax.device_put((_plain(master), _plain(opt), compute, grads), self.cpu)
        opt_tree = treepath.unflatten(jax.eval_shape(self.tx.init, master), opt)
        master, opt_tree, compute = self._update(master, opt_tree, compute, grads, scale)
        return master, treepath.flatten(opt_tree), compute

    def _chunked(self, split: LeafSplit, master, opt, compute, grads, scale):
        key = tuple((n, tuple(np.shape(a))) for n, a in master.items())
        if key not in self._plans:
            self._plans[key] = _plan({n: jax.ShapeDtypeStruct(s, np.float32) for n, s in key}, self.chunk_elems)
        calls, rows = self._plans[key]
        shapes, where = dict(key), {n: _slices(r) for n, r in rows.items()}
        states = {n: {"master": master[n]} | {o: opt[o] for o in split.own[n]} for n in master}  # leaf -> its state
        # The state in chunks: RowChunks of ours are donated to their chunk's program (in
        # place); other arrays (the first update) are read through views.
        src = {n: {s: a.chunks if isinstance(a, RowChunks) and a.rows == rows[n] else np.asarray(a)
                   for s, a in st.items()} for n, st in states.items()}
        grads = {n: np.asarray(g) for n, g in grads.items()}  # host sync: the gradient transfer
        shared = {o: np.asarray(opt[o]) for o in split.shared}
        # Every chunk's views in one device_put (one per chunk costs ~0.5 ms of Python).
        # Zero-copy: device_put of an aligned numpy view aliases it (FACTS: aliasing).
        # Donating such a view only gives a new output, and the engine writes none of
        # these buffers before the update's results are ready. Shared scalars (step
        # counts) get a copy per chunk: each program donates its own.
        views = {}
        for i, call in enumerate(calls):
            views |= {(i, "shared", o): v for o, v in shared.items()}
            for n, k in call:
                views |= {(i, s, n): x[where[n][k]] for s, x in src[n].items() if not isinstance(x, list)}
                views[i, "grad", n] = grads[n][where[n][k]]
        views = jax.device_put(views, self.cpu)
        # Each leaf's compute copy is threaded through its chunks' programs, donated.
        copies = {n: jax.device_put(compute[n], self.cpu) if n in compute
                  else jnp.zeros(shapes[n], self.dtype, device=self.cpu) for n in master}
        scale = jax.device_put(jnp.asarray(scale, jnp.float32), self.cpu)
        new = {n: {s: [None] * len(where[n]) for s in st} for n, st in states.items()}
        shared_out = None
        for i, call in enumerate(calls):  # all dispatched without a host sync
            m, o, g = {}, {x: views[i, "shared", x] for x in shared}, {}
            for n, k in call:
                for s, x in src[n].items():
                    arg = x[k] if isinstance(x, list) else views[i, s, n]  # a donated chunk, or a view
                    if s == "master":
                        m[n] = arg
                    else:
                        o[s] = arg
                g[n] = views[i, "grad", n]
            starts = {n: rows[n][k][0] if rows[n] else 0 for n, k in call}
            o_tree = treepath.unflatten(self._chunk_template(self._signature(call, rows, shapes)), o)
            m, o_tree, c = self._chunk(m, o_tree, {n: copies[n] for n, _ in call}, starts, g, scale)
            copies |= c
            o = treepath.flatten(o_tree)
            for n, k in call:
                for s in states[n]:
                    new[n][s][k] = m[n] if s == "master" else o[s]
            shared_out = shared_out or {x: o[x] for x in split.shared}  # every chunk computes the same
        new_opt = {o: RowChunks(new[n][o], rows[n]) for n in master for o in split.own[n]} | (shared_out or {})
        return ({n: RowChunks(new[n]["master"], rows[n]) for n in master}, {o: new_opt[o] for o in opt}, copies)

    def _fused(self, master, opt, compute, grads, scale, own, copy):
        scalars, (adam_count, schedule_count) = self.fused.step(opt["0.count"], opt["2.count"], scale)
        new_opt = {"0.count": adam_count, "2.count": schedule_count}
        new_master, new_compute, leaves = {}, {}, []
        for n, p in master.items():
            ins = [_host(a) for a in (p, opt[f"0.mu.{n}"], opt[f"0.nu.{n}"])]
            outs = [_target(a, kind in own, np.float32) for a, kind in zip(ins, ("master", "opt", "opt"))]
            bf16 = None
            if copy and self.dtype != np.float32:  # the loop writes it
                bf16 = _target(_host(compute[n]) if n in compute else None, "compute" in own, self.dtype, p.shape)
            grad = np.ascontiguousarray(np.asarray(grads[n]), np.float32)  # host sync: the gradient transfer
            leaves.append(fused_adamw.Leaf(*ins, grad, (*outs, bf16), decay=len(p.shape) > 1))
            new_master[n], new_opt[f"0.mu.{n}"], new_opt[f"0.nu.{n}"], new_compute[n] = *outs, bf16
        self.fused.run(leaves, scalars)
        if copy and self.dtype == np.float32:  # an fp32 copy is the new master; a copy, since it may be overwritten
            new_compute = {n: np.array(a) for n, a in new_master.items()}
        return new_master, {o: new_opt[o] for o in opt}, new_compute if copy else None

    @staticmethod
    def _signature(call, rows, shapes) -> tuple:
        """What a chunk program compiles for: its leaves and their chunk shapes."""
        return tuple((n, (rows[n][k][1] - rows[n][k][0], *shapes[n][1:]) if rows[n] else shapes[n]) for n, k in call)

    def _chunk_template(self, sig: tuple):
        """The optimizer-state tree of one chunk program's leaves."""
        if sig not in self._chunk_templates:
            abstract = {n: jax.ShapeDtypeStruct(shape, np.float32) for n, shape in sig}
            self._chunk_templates[sig] = jax.eval_shape(self.tx.init, abstract)
        return self._chunk_templates[sig]


def _fused_for(cfg: ModelConfig, tx, optim: OptimConfig | None):
    """The one-pass AdamW for `tx` when it is `make_optimizer(optim)`, numba is installed
    and the compute dtype is bf16 or fp32; otherwise None."""
    if optim is None or not fused_adamw.supports(cfg.compute_dtype):
        return None
    state = treepath.flatten(jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((2, 2), np.float32)}))
    if set(state) != {"0.count", "0.mu.w", "0.nu.w", "2.count"}:  # not the chain make_optimizer builds
        return None
    return fused_adamw.FusedAdamW(optim)


def _host(a):
    """A host array of `a` (RowChunks joined; jax CPU arrays viewed, read-only)."""
    return None if a is None else np.asarray(a)


def _target(a, writable: bool, dtype, shape=None) -> np.ndarray:
    """Where an update of `a` goes: `a` itself when it may be overwritten and is a
    writable C-contiguous array of `dtype`; else a new array, on huge pages when it will
    be updated in place from now on (RAM tier)."""
    if writable and isinstance(a, np.ndarray) and a.flags.writeable and a.flags.c_contiguous and a.dtype == dtype:
        return a
    shape = a.shape if a is not None else shape
    return huge_empty(shape, dtype) if writable else np.empty(shape, dtype)


@functools.lru_cache(maxsize=8)
def update_for(cfg: ModelConfig, optim: OptimConfig) -> PartUpdate:
    """The update of an OptimConfig, shared by every engine that uses it."""
    return PartUpdate(cfg, make_optimizer(optim), optim=optim)


def _part_leaf_names(cfg: ModelConfig, tx, part: parts.Part):
    """(per-part opt leaf name, whole-model opt leaf name) pairs of one part."""
    path = "blocks." + part.name.split(".")[1] if part.name.startswith("block.") else part.name
    leaves = sorted(parts.schema(cfg, part.name, "master"), key=len, reverse=True)
    for name in parts.schema(cfg, part.name, "opt", tx):
        leaf = next((x for x in leaves if name == x or name.endswith("." + x)), None)
        yield name, name if leaf is None else f"{name[: -len(leaf)]}{path}.{leaf}"


def split_opt_state(cfg: ModelConfig, tx: optax.GradientTransformation, full) -> dict[str, dict]:
    """The inverse of `full_opt_state`: {part name: flat per-part optimizer state}."""
    named = treepath.flatten(full)
    return {p.name: {mine: np.asarray(named[whole]) for mine, whole in _part_leaf_names(cfg, tx, p)}
            for p in parts.parts(cfg)}


def full_opt_state(cfg: ModelConfig, tx: optax.GradientTransformation, per_part: dict[str, dict]):
    """The optimizer state of the whole model, shaped as `tx.init(params)` would make it.

    A per-part leaf named `<prefix>.<param leaf>` (e.g. "0.mu.mlp.up_proj.kernel") is
    the whole model's `<prefix>.<part path>.<param leaf>`; other leaves (step counts)
    are the same in every part and appear once.
    """
    template = jax.eval_shape(tx.init, model.abstract_params(cfg))
    named = {}
    for p in parts.parts(cfg):
        for mine, whole in _part_leaf_names(cfg, tx, p):
            named.setdefault(whole, per_part[p.name][mine])
    return treepath.unflatten(template, named)
