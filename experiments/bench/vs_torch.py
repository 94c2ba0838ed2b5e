"""Side by side with what a CPU user would otherwise run: Hugging Face transformers + torch.

The same Llama shape (8 blocks x width 1024, 16 heads, SwiGLU 2816, vocab 8192, seq 512,
batch 1) trained three ways in one process, steps interleaved so drift in machine load hits
all alike, in fp32 and then with bf16 compute (fp32 master weights and optimizer state in
both frameworks: torch under `torch.autocast("cpu", torch.bfloat16)`, mtjax with the model's
compute_dtype bfloat16): transformers' LlamaForCausalLM with per-layer gradient checkpointing,
SDPA attention and torch.optim.AdamW(fused=True) (in a worker process, so torch's OpenMP
threads and XLA's never spin against each other); mtjax's in-memory ReferenceTrainer (remat
per block, either rerunning whole blocks in the backward as torch does, or keeping the
blocks' projection outputs: remat policy "dots"); mtjax's StreamEngine (RAM tier, k = 1,
prefetch depth 2; and with every part resident, as an unlimited device budget lets it,
keeping the projections as the reference's "dots" does). All clip gradients at 1.0. Prints tokens/s and the ratios to torch, then
the time of each piece of a step in both frameworks (one block forward, one block forward +
backward, head + loss forward + backward, clip + AdamW); writes the section of
docs/benchmarks.md of this CPU's vendor (vs-torch-intel, vs-torch-amd, ...), headed by the
CPU's model name, and the notes' section (vs-torch-notes). On a shared machine,
cpu_pieces.py compares the pieces by CPU time instead.

    .venv/bin/python experiments/bench/vs_torch.py                  # ~6-8 minutes on 2 cores (both dtypes)
    .venv/bin/python experiments/bench/vs_torch.py --layers 2 --width 256 --seq 128 --no-doc   # smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import harness  # first: the checkout on sys.path, JAX on the CPU

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

from mtjax import model
from mtjax.config import StreamConfig
from mtjax.loss import head_loss
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, clip_scale, sum_of_squares
from mtjax.reference import ReferenceTrainer
from mtjax.stream import StreamEngine

# Each CPU vendor's run has its own section (vs-torch-intel, vs-torch-amd, ...: a run
# replaces only its own kind's figures); NOTES, the same for all, have one of their own.
SECTION = "vs-torch"

# What was tried to close the gap, with how it was measured (kept with the table it explains).
NOTES = """Runs before 2026-11-30 let the streamed engine's deferred optimizer update run during torch's next
timed step (in its worker process, on the same 2 cores). That slowed torch by about 10% (3.38 s per step
then, 2.9-3.05 s since) and hid the update from the streamed figure; their ratios (reference 1.06x, stream
1.04x) overstated mtjax. Measured fairly, before the flat-matrix, cross-entropy and gradient-donation
changes below, the reference with whole-block remat was 0.90-0.95x torch.

AMD EPYC Zen 4 (AVX-512 BF16, no AMX), 2026-12-07 (issue 33's bf16 part; docs/cpu.md has the
tables): XLA's bf16 dots run on the bf16 instructions (1.9x the fp32 matmul rate), and every
dot of a block's forward and backward takes bf16 operands. The head + loss's kernel gradient
was upcast to fp32 until its tokens-major operand became a transposed copy (mtjax.loss): head +
loss forward + backward in bf16 200-216 -> 162-163 ms CPU, torch's 151-179 (cpu_pieces.py). Until then the
head piece timed cross_entropy of whole fp32 logits, differentiated by JAX (its backward dots
fp32), a program no trainer runs: the Intel bf16 head figure (100.5 ms, 2.98x) is that
program's; it now times mtjax.loss.head_loss, as training runs it.

Intel Xeon (Sapphire Rapids), 2026-12-04 (issue 33; docs/cpu.md has the tables): the
fp32 flags tried before were tried again on one block, by CPU time (the machine was shared,
load 6-9): YNNPACK off, oneDNN, `--xla_cpu_prefer_vector_width=512`, the old runtime (no
longer accepted) were all equal or slower; oneDNN dot fusions crashed XLA. Fused q/k/v and
gate/up matmuls measured the same as separate ones. What is left in fp32 is the matmul
kernel: XLA's (YNNPACK, oneDNN or Eigen) 140-160 GFLOP per CPU-second on [512 x 1024] @
[1024 x 2816], torch's 164-175. With bf16 compute the forward's matmuls run on AMX (one
block forward ~37 ms CPU against ~135 in fp32); the projections' backward is written out
(mtjax.layers.basic `_low_dot`) so that its dots are bf16 too: JAX's derivative made them
fp32, and XLA upcasts the weight gradient's dot unless its token-major operand is a copy
transposed of its own (block forward + backward 294-323 -> 148-168 ms CPU; torch's bf16
block ~131-145).

What changed to get here (2026-11-30 and before, AMD Zen 4), each measured in one process with the variants interleaved and
compared by CPU seconds (the machine was shared, load 3-10; CPU time was stable to ~3% where wall
time was not), width 1024, seq 512, fp32:

- Attention (mtjax/attention_chunked.py, used on the CPU backend): query chunks of 128 rows score only
  the keys they can see, and the backward is written out (probabilities recomputed from the saved
  log-sum-exp). One attention fwd + bwd: 94 -> 74 ms CPU; one block fwd + bwd: 543 -> 506 ms CPU
  (-7%). Equal to `jax.nn.dot_product_attention` to ~3e-7 relative (tests/test_attention.py).
- Remat policy "dots" (model.REMAT_POLICIES; `ReferenceTrainer(remat="dots")`): the backward keeps
  each block's projection outputs (about 4 d + 2 f floats per token, 11x the activations of
  "full" at this shape, ~22 MB per block here) and recomputes only norms, RoPE, attention and
  SwiGLU. Reference step: 6.7 -> 5.8 s CPU (-12%). Torch's gradient checkpointing corresponds to
  "full"; "dots" trades memory torch's setting does not spend.
- Reference step as two programs (gradients, host finiteness check, donated update) instead of
  one with a select over the whole state, which made XLA copy m and v: 6.3 -> 6.05 s CPU (-4%).
- XLA CPU flags, none outside noise (block fwd + bwd 488-519 ms CPU against 507 default):
  `xla_cpu_enable_concurrency_optimized_scheduler` on and off, `xla_cpu_experimental_xnn_graph_fusion_mode=
  XNN_GRAPH_FUSION_MODE_GREEDY`, `xla_cpu_experimental_ynn_fusion_type=+eltwise`; disabling the
  default YNNPACK dot fusions or using oneDNN was slower. So mtjax sets no XLA flags.
- Before these changes (previous quiet run, same script): torch 2.8 s, reference 4.0 s, stream
  3.7 s per step. The stream also gained from the faster per-block optimizer update
  (mtjax/stream/update.py, changed separately), which the reference does not use.
- Flat matrices (2026-11-30; mtjax/model.py `_dot`, `rms_norm`, `head_forward`). On [b, t, d]
  arrays XLA wrote the activation gradients transposed for the weight-gradient dots (a strided
  copy of each [t, f] gradient) and ran the norms' reductions through a slow fusion (one norm
  forward + backward 4.7 ms; 0.3 ms flat). With tokens flattened into one axis first, one block
  forward + backward went from ~265 to ~242 ms wall.
- Cross-entropy (mtjax/loss.py) on one [b*t, v] matrix: no sliced copy of the logits and the
  target logit picked by comparison with the vocabulary index, so the backward is one
  elementwise pass instead of a scatter. Head + loss forward + backward: 175 -> 146 ms.
- The reference donates the last step's gradients to the next gradient program, so the 480 MB
  of gradients land in pages already mapped (fresh pages cost ~0.2 s per GiB): 2.98 -> 2.83 s
  per step, two trainers interleaved.
- Tried without gain: attention with K and V transposed once per call instead of per query
  chunk (with and without an optimization barrier), or accumulating dK and dV transposed; a
  longer forward chunk than the backward's; mallopt to keep freed memory mapped (XLA's 400 MB
  temporary buffer is still mapped afresh each step, from its threads' arenas).
- Tried and dropped: glibc's allocator on transparent huge pages (GLIBC_TUNABLES=
  glibc.malloc.hugetlb=1). Alone in a process the reference step went 2.70 -> 2.60 s and the
  streamed RAM tier 1.62 -> 1.43 s (width 1024, 4 blocks); in this benchmark, with every trainer
  in one process, the reference was 2.93-3.02 s with it and 2.78-2.83 s without.
- The spread, 2026-11-30: seven runs of this script after the changes above (without the
  huge-page tunable) gave the reference 1.00-1.08x torch (median 1.04x) and the stream
  0.98-1.02x.
- Not done: fused qkv / gate-up matmuls (XLA's matmuls already run at ~200 GFLOP/s, the two
  cores' fp32 peak, in both frameworks). What is left per block is attention: forward + backward
  ~42 ms here against ~27 ms for torch's fused CPU flash-attention kernel.
"""


class TorchTrainer:
    """transformers Llama, gradient checkpointing per layer, fused AdamW, fp32 weights; the
    forward and backward under bf16 autocast when `args.dtype` is bfloat16."""

    def __init__(self, args):
        from transformers import LlamaConfig, LlamaForCausalLM

        heads = args.width // 64
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=int(args.width * 2.75),
                          num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                          max_position_embeddings=args.seq, tie_word_embeddings=False)
        torch.manual_seed(0)
        self.model = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
        enable = getattr(self.model, "activation_checkpointing_enable", None) or self.model.gradient_checkpointing_enable
        enable()  # per decoder layer
        self.model.config.use_cache = False
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        self.autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")

    def step(self, tokens: np.ndarray) -> float:
        ids = torch.from_numpy(tokens[0].astype(np.int64))
        with self.autocast:
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.update()
        return float(loss.detach())

    def update(self):
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def pieces(self, tokens: np.ndarray, reps: int) -> dict[str, float]:
        """Milliseconds of each piece of a step, best of `reps` (checkpointing off while timed)."""
        m = self.model.model
        ids = torch.from_numpy(tokens[0].astype(np.int64))
        x = torch.randn(*ids.shape, m.config.hidden_size, requires_grad=True)
        pe = m.rotary_emb(x, torch.arange(ids.shape[-1])[None])
        layer = m.layers[0]

        def block_fwd():
            with torch.no_grad(), self.autocast:
                layer(x, position_embeddings=pe)

        def block_fwd_bwd():
            with self.autocast:
                out = layer(x, position_embeddings=pe)
            (out[0] if isinstance(out, tuple) else out).float().sum().backward()

        def head():
            with self.autocast:
                logits = self.model.lm_head(m.norm(x))
            torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).backward()

        def update():
            for q in self.model.parameters():
                q.grad = torch.zeros_like(q) if q.grad is None else q.grad
            self.update()

        self.model.gradient_checkpointing_disable()
        out = {name: best_ms(fn, reps) for name, fn in PIECES(block_fwd, block_fwd_bwd, head, update).items()}
        self.model.gradient_checkpointing_enable()
        return out


class TorchWorker:
    """TorchTrainer in a child process; `step` sends the batch index, gets the step seconds."""

    def __init__(self, argv):
        self.proc = subprocess.Popen([sys.executable, __file__, "--torch-worker", *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        self.i = 0

    def step(self, tokens) -> float:
        self.proc.stdin.write(f"{self.i}\n")
        self.proc.stdin.flush()
        self.i += 1
        return float(self.proc.stdout.readline())

    def pieces(self, reps: int) -> dict[str, float]:
        self.proc.stdin.write(f"pieces {reps}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def torch_worker(args) -> None:
    trainer = TorchTrainer(args)
    data = batches(args)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.startswith("pieces"):
            print(json.dumps(trainer.pieces(data[0], int(line.split()[1]))), flush=True)
            continue
        t0 = time.perf_counter()
        trainer.step(data[int(line)])
        print(time.perf_counter() - t0, flush=True)


def PIECES(block_fwd, block_fwd_bwd, head, update) -> dict:
    """The pieces of a step, named alike for both frameworks."""
    return {"one block: forward": block_fwd, "one block: forward + backward": block_fwd_bwd,
            "head + loss: forward + backward": head, "clip + AdamW, all parameters": update}


def best_ms(fn, reps: int) -> float:
    """Best of `reps` timed calls after one warm-up, in ms; fn must return only when its work is done."""
    return 1000 * harness.best_seconds(fn, reps, warmup=1)


def jax_pieces(cfg: ModelConfig, trainer: ReferenceTrainer, tokens: np.ndarray, reps: int) -> dict[str, float]:
    """The same pieces for mtjax, each one jitted program (the reference trainer's state)."""
    params, ids = trainer.params, jnp.asarray(tokens[0])
    block, head_p, embed = params["blocks"][0], params["head"], params["embed"]
    x = model.embed_forward(cfg, embed, ids)
    fwd = jax.jit(lambda b, x: model.block_forward(cfg, cfg.layer_specs[0], b, x))
    grad = jax.jit(lambda b, x: jax.vjp(lambda b, x: model.block_forward(cfg, cfg.layer_specs[0], b, x), b, x)[1](x))
    # The head and loss as training runs them (chunked, its backward written out: mtjax.loss).
    head = jax.jit(jax.grad(lambda h, x: head_loss(cfg, h, embed, x, ids), argnums=(0, 1)))

    def adamw(p, s, g):
        scale = clip_scale(sum_of_squares(g), trainer.clip_norm)
        updates, s = trainer.tx.update(jax.tree.map(lambda a: a * scale, g), s, p)
        return optax.apply_updates(p, updates), s

    update = jax.jit(adamw, donate_argnums=(0, 1))
    state = [jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, trainer.opt_state)]
    grads = jax.tree.map(lambda a: a * 1e-3, params)

    def step_update():
        state[:] = update(state[0], state[1], grads)
        jax.block_until_ready(state)

    fns = PIECES(lambda: jax.block_until_ready(fwd(block, x)), lambda: jax.block_until_ready(grad(block, x)),
                 lambda: jax.block_until_ready(head(head_p, x)), step_update)
    return {name: best_ms(fn, reps) for name, fn in fns.items()}


def batches(args) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, args.vocab, (1, 1, args.seq), dtype=np.int32) for _ in range(args.steps + 1)]


def piece_table(pieces: dict, reps: int, dtype: str) -> list[str]:
    if not pieces:
        return []
    (a, ta), (b, tb) = pieces.items()
    return [f"Pieces of a step in {dtype}, each timed alone (best of {reps}, ms; torch without checkpointing while "
            "timed):", "",
            f"| piece | {a} | {b} | {b} / {a} |", "|---|---|---|---|",
            *(f"| {k} | {ta[k]:.1f} | {tb[k]:.1f} | {tb[k] / ta[k]:.2f} |" for k in ta), ""]


def cpu_vendor() -> str:
    """"Intel", "AMD" or the vendor id /proc/cpuinfo gives (the machine's architecture without one)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.machine()
    vendor = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("vendor_id")), "")
    return {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}.get(vendor, vendor or platform.machine())


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo) and its vector units that matter here."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    units = [u for u, f in (("AVX-512", "avx512f"), ("AVX-512 BF16", "avx512_bf16"), ("AMX", "amx_bf16"))
             if f in flags]
    return f"{name or platform.machine()}" + (f" ({', '.join(units)})" if units else "")


def run_dtype(args, dtype: str) -> tuple[ModelConfig, dict, dict]:
    """(config, {trainer: every timed step's seconds}, {framework: piece ms}) of one compute dtype."""
    cfg = harness.llama(args.layers, args.width, vocab=args.vocab, dtype=dtype)
    params = model.init_params(cfg, seed=0)  # fp32 masters whatever the compute dtype
    opt = OptimConfig(lr=1e-4, clip_norm=1.0, schedule="constant")
    trainers = {
        "transformers + torch (grad checkpointing, fused AdamW)": TorchWorker(
            [f"--{k}={getattr(args, k)}" for k in ("layers", "width", "seq", "vocab", "steps")] + [f"--dtype={dtype}"]),
        "mtjax reference (in memory, remat per block)": ReferenceTrainer(cfg, params, opt),
        "mtjax reference (in memory, remat per block keeping projections)": ReferenceTrainer(cfg, params, opt,
                                                                                             remat="dots"),
        "mtjax stream (RAM tier, k=1, depth 2)": StreamEngine(cfg, params, opt,
                                                              StreamConfig(keep_every=1, prefetch_depth=2)),
        # With the budget for the whole state the stream may keep the projections as the reference does.
        "mtjax stream (all resident, remat per block keeping projections)": StreamEngine(
            cfg, params, opt, StreamConfig(keep_every=1, prefetch_depth=2, resident="all", remat="dots")),
    }
    del params
    times = {name: [] for name in trainers}
    for i, tokens in enumerate(batches(args)):
        for name, t in trainers.items():
            t0 = time.perf_counter()
            took = t.step(tokens)  # returns host floats: the step has finished
            if isinstance(t, StreamEngine):
                # Its optimizer update is deferred to overlap its next forward; finished
                # here so that none of it runs during (and slows) another trainer's step.
                t.flush()
            if i:  # step 0 compiles / warms up
                times[name].append(took if isinstance(t, TorchWorker) else time.perf_counter() - t0)
        print(dtype, i, {k: round(v[-1], 2) for k, v in times.items() if v}, flush=True)
    torch_trainer, reference = list(trainers.values())[:2]
    pieces = {}
    if args.piece_reps:
        pieces = {"transformers + torch": torch_trainer.pieces(args.piece_reps),
                  "mtjax": jax_pieces(cfg, reference, batches(args)[0], args.piece_reps)}
    for t in trainers.values():
        if hasattr(t, "close"):
            t.close()
    return cfg, times, pieces


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.shape_options(ap, layers=8, width=1024, seq=512, vocab=8192, steps=3,
                          steps_help="timed steps per trainer (after one warm-up)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="compute dtypes to run, in turn (comma-separated)")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    ap.add_argument("--piece-reps", type=int, default=5, help="timed calls per piece (0 skips the pieces table)")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)  # the torch worker's
    args = ap.parse_args()
    load_at_start = os.getloadavg()[0]
    torch.set_num_threads(os.cpu_count() or 1)
    if args.torch_worker:
        return torch_worker(args)
    dtypes = args.dtypes.split(",")
    bad = [d for d in dtypes if d not in ("float32", "bfloat16")]
    if bad:
        sys.exit(f"--dtypes: {', '.join(bad)} not float32 or bfloat16")

    runs = {dtype: run_dtype(args, dtype) for dtype in dtypes}
    cfg = next(iter(runs.values()))[0]
    torch_fp32 = statistics.median(next(iter(runs["float32"][1].values()))) if "float32" in runs else None
    rows = []
    for dtype, (_, times, _) in runs.items():
        med = {k: statistics.median(v) for k, v in times.items()}
        torch_s = next(iter(med.values()))
        for k, sec in med.items():
            vs_fp32 = f"{torch_fp32 / sec:.2f}x" if torch_fp32 else ""
            rows.append(f"| {k} | {dtype} | {sec:.2f} | {args.seq / sec:.0f} | {torch_s / sec:.2f}x | {vs_fp32} | "
                        f"{', '.join(f'{t:.2f}' for t in times[k])} |")
    lines = [
        f"{datetime.date.today()}, {cpu_name()}, {platform.node()} ({os.cpu_count()} cores), jax {jax.__version__}, "
        f"torch {torch.__version__}, load average {load_at_start:.1f} at the start and {os.getloadavg()[0]:.1f} at "
        f"the end (the run itself keeps both cores busy). Llama {args.layers} blocks x width "
        f"{args.width} ({model.num_params(cfg) / 1e6:.1f}M params), vocab {args.vocab}, batch 1 x seq {args.seq}, "
        f"fp32 master weights and AdamW state, compute in the row's dtype (torch: bf16 autocast), clip 1.0; median "
        f"of {args.steps} steps after one warm-up, the trainers' steps interleaved (torch in a worker process; the "
        f"streamed step includes finishing its deferred update, so that none of it runs during another trainer's "
        f"step); each dtype's trainers run together, one dtype after the other.",
        "",
        "| trainer | compute | step (s) | tokens/s | vs torch, same compute (tokens/s ratio) | vs torch fp32 | "
        "every timed step (s) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Goal (issue 33): in fp32, reference >= 1.0x torch and stream >= 0.97x torch.",
        "",
        *(line for dtype, (_, _, pieces) in runs.items() for line in piece_table(pieces, args.piece_reps, dtype)),
    ]
    vendor = cpu_vendor()
    harness.publish(f"{SECTION}-{vendor.lower()}",
                    f"mtjax vs transformers + torch on the CPU: {vendor} (experiments/bench/vs_torch.py)",
                    "\n".join(lines), "experiments/bench/vs_torch.py", write=not args.no_doc)
    harness.publish(f"{SECTION}-notes", "mtjax vs transformers + torch on the CPU: what was tried", NOTES,
                    "experiments/bench/vs_torch.py", write=not args.no_doc)


if __name__ == "__main__":
    main()
