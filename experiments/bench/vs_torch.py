"""Side by side with what a CPU user would otherwise run: Hugging Face transformers + torch.

The same Llama shape (8 blocks x width 1024, 16 heads, SwiGLU 2816, vocab 8192, seq 512,
batch 1, fp32) trained three ways in one process, steps interleaved so drift in machine
load hits all alike: transformers' LlamaForCausalLM with per-layer gradient checkpointing,
SDPA attention and torch.optim.AdamW(fused=True) (in a worker process, so torch's OpenMP
threads and XLA's never spin against each other); mtjax's in-memory ReferenceTrainer (remat
per block); mtjax's StreamEngine (RAM tier, k = 1, prefetch depth 2). All clip gradients at
1.0. Prints tokens/s and the ratios to torch; writes its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/vs_torch.py                  # ~3-4 minutes on 2 cores
    .venv/bin/python experiments/bench/vs_torch.py --layers 2 --width 256 --seq 128 --no-doc   # smoke
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from mtjax import model  # noqa: E402
from mtjax.model_config import ModelConfig  # noqa: E402
from mtjax.optim import OptimConfig  # noqa: E402
from mtjax.reference import ReferenceTrainer  # noqa: E402
from mtjax.stream import StreamEngine  # noqa: E402

SECTION = "vs-torch"


class TorchTrainer:
    """transformers Llama, gradient checkpointing per layer, fused AdamW, fp32."""

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

    def step(self, tokens: np.ndarray) -> float:
        ids = torch.from_numpy(tokens[0].astype(np.int64))
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


class TorchWorker:
    """TorchTrainer in a child process; `step` sends the batch index, gets the step seconds."""

    def __init__(self, argv):
        import subprocess

        self.proc = subprocess.Popen([sys.executable, __file__, "--torch-worker", *argv],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"
        self.i = 0

    def step(self, tokens) -> float:
        self.proc.stdin.write(f"{self.i}\n")
        self.proc.stdin.flush()
        self.i += 1
        return float(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def torch_worker(args) -> None:
    trainer = TorchTrainer(args)
    data = batches(args)
    print("ready", flush=True)
    for line in sys.stdin:
        t0 = time.perf_counter()
        trainer.step(data[int(line)])
        print(time.perf_counter() - t0, flush=True)


def batches(args) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, args.vocab, (1, 1, args.seq), dtype=np.int32) for _ in range(args.steps + 1)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per trainer (after one warm-up)")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    ap.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.torch_worker:
        return torch_worker(args)

    heads = args.width // 64
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=int(args.width * 2.75),
                      num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=heads,
                      head_dim=64, compute_dtype="float32")
    params = model.init_params(cfg, seed=0)
    opt = OptimConfig(lr=1e-4, clip_norm=1.0, schedule="constant")
    trainers = {
        "transformers + torch (grad checkpointing, fused AdamW)": TorchWorker(
            [f"--{k}={getattr(args, k)}" for k in ("layers", "width", "seq", "vocab", "steps")]),
        "mtjax reference (in memory, remat per block)": ReferenceTrainer(cfg, params, opt),
        "mtjax stream (RAM tier, k=1, depth 2)": StreamEngine(cfg, params, opt, keep_every=1, prefetch_depth=2),
    }
    del params
    times = {name: [] for name in trainers}
    for i, tokens in enumerate(batches(args)):
        for name, t in trainers.items():
            t0 = time.perf_counter()
            took = t.step(tokens)  # returns host floats: the step has finished
            if i:  # step 0 compiles / warms up
                times[name].append(took if isinstance(t, TorchWorker) else time.perf_counter() - t0)
        print(i, {k: round(v[-1], 2) for k, v in times.items() if v}, flush=True)
    for t in trainers.values():
        if hasattr(t, "close"):
            t.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    torch_s = next(iter(med.values()))
    lines = [
        f"{datetime.date.today()}, {platform.node()} ({os.cpu_count()} cores), jax {jax.__version__}, torch "
        f"{torch.__version__}, load average {os.getloadavg()[0]:.1f} at the end. Llama {args.layers} blocks x width "
        f"{args.width} ({cfg.num_params() / 1e6:.1f}M params), vocab {args.vocab}, batch 1 x seq {args.seq}, fp32, "
        f"AdamW + clip 1.0; median of {args.steps} steps after one warm-up, the three trainers' steps interleaved "
        f"(torch in a worker process).",
        "",
        "| trainer | step (s) | tokens/s | vs torch (tokens/s ratio) |",
        "|---|---|---|---|",
        *(f"| {k} | {s:.2f} | {args.seq / s:.0f} | {torch_s / s:.2f}x |" for k, s in med.items()),
        "",
        "Goal: reference >= 1.0x torch, stream >= 0.9x torch.",
        "",
        "Command: `.venv/bin/python experiments/bench/vs_torch.py`",
    ]
    body = "## mtjax vs transformers + torch on the CPU (experiments/bench/vs_torch.py)\n\n" + "\n".join(lines)
    print(body)
    if not args.no_doc:
        from benchdoc import write_section

        write_section(SECTION, body)


if __name__ == "__main__":
    main()
