"""The pieces of a training step, mtjax against transformers + torch, by CPU time: for a
shared machine, where vs_torch.py's wall-clock steps are not comparable.

One Llama block forward, its forward + backward, and the head + loss forward + backward
(mtjax.loss.head_loss, as training runs it), in fp32 and with bf16 compute (fp32 weights:
torch under bf16 autocast, mtjax with compute_dtype bfloat16), both frameworks in this one
process, every piece called in turn each round so that drift in the machine's load hits
all alike. Torch's OpenMP threads wait passively (OMP_WAIT_POLICY=PASSIVE, set before torch
loads), so that their spinning is not counted as its work. Prints the CPU milliseconds
(best and median of the rounds) and writes its section of docs/benchmarks.md.

    .venv/bin/python experiments/bench/cpu_pieces.py                 # ~2 minutes on 2 cores
    .venv/bin/python experiments/bench/cpu_pieces.py --width 256 --seq 128 --rounds 2 --no-doc   # smoke
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads its OpenMP runtime

import harness  # noqa: E402  (first: the checkout on sys.path, JAX on the CPU)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from vs_torch import cpu_name  # noqa: E402

from mtjax import model  # noqa: E402
from mtjax.loss import head_loss  # noqa: E402

PIECES = ("one block: forward", "one block: forward + backward", "head + loss: forward + backward")


def mtjax_pieces(width: int, seq: int, vocab: int, dtype: str) -> list:
    cfg = harness.llama(1, width, vocab=vocab, dtype=dtype)
    params = model.init_params(cfg, seed=0)  # fp32, cast to the compute dtype in each program
    ids = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (1, seq), dtype=np.int32))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, seq, width)), dtype)
    block, head = params["blocks"][0], params["head"]

    def forward(b, x):
        return model.block_forward(cfg, cfg.layer_specs[0], b, x)

    fwd = jax.jit(forward)
    grad = jax.jit(lambda b, x: jax.vjp(forward, b, x)[1](x))
    head_grad = jax.jit(jax.grad(lambda h, x: head_loss(cfg, h, params["embed"], x, ids), argnums=(0, 1)))
    return [lambda: jax.block_until_ready(fwd(block, x)), lambda: jax.block_until_ready(grad(block, x)),
            lambda: jax.block_until_ready(head_grad(head, x))]


def torch_pieces(width: int, seq: int, vocab: int, dtype: str) -> list:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=int(width * 2.75), num_hidden_layers=1,
                      num_attention_heads=width // 64, num_key_value_heads=width // 64, max_position_embeddings=seq,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    lm = LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    inner, layer = lm.model, lm.model.layers[0]
    ids = torch.randint(0, vocab, (1, seq))
    x = torch.randn(1, seq, width, requires_grad=True)
    pe = inner.rotary_emb(x, torch.arange(seq)[None])

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16")

    def fwd():
        with torch.no_grad(), autocast():
            layer(x, position_embeddings=pe)

    def fwd_bwd():
        with autocast():
            out = layer(x, position_embeddings=pe)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    def head():
        with autocast():
            logits = lm.lm_head(inner.norm(x))
        torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:]).backward()

    return [fwd, fwd_bwd, head]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.shape_options(ap, width=1024, seq=512, vocab=8192, steps_help="")
    ap.add_argument("--rounds", type=int, default=7, help="timed calls of every piece (after two warm-ups)")
    ap.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    load_at_start = os.getloadavg()[0]
    calls = {}
    for dtype in ("float32", "bfloat16"):
        for framework, make in (("torch", torch_pieces), ("mtjax", mtjax_pieces)):
            for piece, fn in zip(PIECES, make(args.width, args.seq, args.vocab, dtype)):
                calls[(piece, dtype, framework)] = fn
    for fn in calls.values():
        fn(), fn()  # compile, warm up
    cpu = {k: [] for k in calls}
    for _ in range(args.rounds):
        for k, fn in calls.items():
            c0 = time.process_time()
            fn()
            cpu[k].append(1000 * (time.process_time() - c0))

    def cell(k):
        return f"{min(cpu[k]):.1f} ({statistics.median(cpu[k]):.1f})"

    rows = [f"| {piece} | {dtype} | {cell((piece, dtype, 'torch'))} | {cell((piece, dtype, 'mtjax'))} | "
            f"{min(cpu[(piece, dtype, 'mtjax')]) / min(cpu[(piece, dtype, 'torch')]):.2f} |"
            for dtype in ("float32", "bfloat16") for piece in PIECES]
    body = "\n".join([
        f"{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores, jax {jax.__version__}, torch "
        f"{torch.__version__}, load average {load_at_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the "
        f"end. One Llama block of width {args.width} ({args.width // 64} heads, SwiGLU {int(args.width * 2.75)}), "
        f"batch 1 x seq {args.seq}, vocab {args.vocab}; fp32 weights, compute in the row's dtype (torch: bf16 "
        f"autocast); both frameworks in one process, interleaved, {args.rounds} rounds after two warm-ups; ms of CPU "
        "time, best (median). For a shared machine: vs_torch.py's wall-clock figures are the ones that count when "
        "it is quiet.",
        "",
        "| piece | compute | transformers + torch | mtjax | mtjax / torch (best) |",
        "|---|---|---|---|---|",
        *rows,
    ])
    harness.publish("cpu-pieces", "Pieces of a step by CPU time, mtjax vs torch (experiments/bench/cpu_pieces.py)",
                    body, "experiments/bench/cpu_pieces.py", write=not args.no_doc)


if __name__ == "__main__":
    main()
