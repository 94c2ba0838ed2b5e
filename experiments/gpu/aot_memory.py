"""XLA:GPU's memory of the streamed step's programs, compiled for an H200 without a GPU (issue 31).

The 2026-12-04 H200 run (experiments/gpu/bench.py's defaults) peaked at 33.4 GB in XLA's
allocator where the device plan (mtjax.stream.memory_plan.DevicePlan) says 10.9 GB. This
script compiles, at the bench's shapes, the programs the engine runs once per part and
micro-batch (mtjax.stream.blockfns: a block's forward, a block's recompute + backward
`_grad`, the LM head's loss and gradients) twice: for this machine's CPU, and for an
H200 with no GPU here (XLA's deviceless compile: `jax.experimental.topologies`, a
target description below, the program traced under the target's abstract mesh so that
mtjax.target picks the GPU paths). It prints each program's temporaries, arguments and
outputs from `compiled.memory_analysis()` beside the plan's term for it.

Needs a jax with the CUDA plugin (not the project's dependencies; e.g. a venv of its own:
`pip install -e . 'jax[cuda13]==0.10.2'`), and nothing runs: every array is a shape.
The CUDA compute capability mtjax's attention asks the device for (none here) is set to
the target's, and the compile of the chosen kernel is the probe (`attention._refused`
would compile for the CPU).

    JAX_PLATFORMS=cpu python experiments/gpu/aot_memory.py [--seq 512 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from unittest import mock
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import add_model_args, model_config  # noqa: E402  the bench's model

from mtjax import attention, loss, parts  # noqa: E402
from mtjax.config import StoreConfig, StreamConfig  # noqa: E402
from mtjax.model_config import ModelConfig  # noqa: E402
from mtjax.optim import OptimConfig, make_optimizer  # noqa: E402
from mtjax.partid import EMBED, HEAD  # noqa: E402
from mtjax.stream import block_bytes, blockfns, schedule, step_bytes  # noqa: E402

# An H200 (SXM, 141 GB) as XLA's GPU compiler sees it: a GpuTargetConfigProto (text).
# Only what the compiler reads for these programs; memory size as the device reports it.
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: 233472  threads_per_core_limit: 2048  core_count: 132  fpus_per_core: 128
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000  l2_cache_size: 52428800  clock_rate_ghz: 1.98
  device_memory_size: 151397597184  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200"
"""
CAPABILITY = 9.0


class Target:
    """Where programs are compiled: this process's CPU, or the H200 description (no device)."""

    def __init__(self, name: str):
        self.name = name
        if name == "gpu":
            from jax.experimental import topologies
            topo = topologies.get_topology_desc(platform="cuda", target_config=H200, topology="1x1x1")
            self.mesh = jax.sharding.Mesh(np.array(topo.devices), ("d",))
        else:
            self.mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("d",))

    def shape(self, s: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        """`s` placed whole on the target's one device."""
        whole = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=whole)

    def compile(self, fn, args, donate=()):
        """memory_analysis of `fn` jitted for this target (donating arguments `donate`),
        `args` its arguments' shapes (pytrees)."""
        args = jax.tree.map(self.shape, args)
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh), self._gpu_attention():
            compiled = jax.jit(fn, donate_argnums=donate).trace(*args).lower().compile()
        return compiled.memory_analysis()

    def plan_terms(self, cfg: ModelConfig, batch: int, seq: int) -> dict:
        """The device plan's per-program terms traced for this target: one block's vjp
        residuals, its working bytes (mixer and feed-forward), the head's chunk of logits."""
        spec = cfg.layer_specs[0]
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh), self._gpu_attention():
            residual = block_bytes._traced_residual_bytes.__wrapped__(cfg, spec, batch, seq, "none")
        working = block_bytes.block_working_bytes(cfg, batch, seq, platform=self.name)
        return {"residuals": residual, "working": working, "head": loss.head_bytes(cfg, batch * seq, self.name)}

    def _gpu_attention(self):
        """On the GPU target: the H200's capability, and no CPU-compiled probe."""
        if self.name != "gpu":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(attention, "cuda_capability", lambda: CAPABILITY))
        stack.enter_context(mock.patch.object(attention, "_refused", lambda *a, **k: False))
        return stack


def programs(cfg: ModelConfig, batch: int, seq: int) -> dict:
    """{name: (function, argument shapes, donated arguments)} of the engine's programs run
    once per part and micro-batch."""
    spec = cfg.layer_specs[0]
    w = parts.schema(cfg, "block.0", "compute")
    x = jax.ShapeDtypeStruct((batch, seq, cfg.hidden_size), jnp.dtype(cfg.compute_dtype))
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    head = parts.schema(cfg, HEAD, "compute")
    embed = parts.schema(cfg, EMBED, "compute") if cfg.tie_word_embeddings else None
    weight = jax.ShapeDtypeStruct((), jnp.float32)
    f32 = {n: jax.ShapeDtypeStruct(s.shape, jnp.float32) for n, s in w.items()}
    return {
        "block forward": (functools.partial(blockfns._block, cfg, spec), (w, x), ()),
        "block recompute + backward": (lambda w, x, dy: blockfns._grad(cfg, spec, w, x, dy, {}), (w, x, x), ()),
        "block gradient into its fp32 sum": (blockfns._add_f32, (f32, w), (0,)),
        "head loss + grads": (lambda h, x, t, wt: blockfns._head(cfg, h, embed, x, t, wt), (head, x, tokens, weight),
                              ()),
        "embedding backward": (functools.partial(blockfns._embed_backward, cfg), (tokens, x), ()),
    }


# The plan's term for each program's temporaries (DevicePlan: a block's forward is not
# priced on its own, it holds less than its backward; the head's chunk of logits).
PRICED = {
    "block forward": lambda t, mib: "-",
    "block recompute + backward": lambda t, mib: f"residuals + working {mib(t['residuals'] + t['working'])}",
    "block gradient into its fp32 sum": lambda t, mib: "-",
    "head loss + grads": lambda t, mib: f"head {mib(t['head'])}",
    "embedding backward": lambda t, mib: "-",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--targets", default="gpu,cpu", help="comma-separated: gpu (the H200, deviceless), cpu")
    a = ap.parse_args()
    cfg = model_config(a)
    try:
        targets = [Target(t) for t in a.targets.split(",")]
    except Exception as e:  # no CUDA plugin in this jax, or it refuses the description
        print(f"aot_memory: cannot compile for an H200 here ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
              "install jax with its CUDA plugin (pip install 'jax[cuda13]') in a venv of its own", file=sys.stderr)
        return 2
    stream = StreamConfig(prefetch_depth=2, keep_every=1, activations="host")
    plan = schedule.describe(cfg, stream, StoreConfig(), step_bytes.StepShape(a.batch, a.seq, a.accum),
                             make_optimizer(OptimConfig())).device
    mib = lambda n: f"{n / 2**20:,.0f}"  # noqa: E731
    print(f"Llama {a.layers} blocks x width {a.width} (FFN {a.ffn}, vocab {a.vocab}), bf16, micro-batch "
          f"{a.batch} x {a.seq}; jax {jax.__version__}; MiB")
    print(f"device plan (traced on {jax.default_backend()}): total {mib(plan.total)}: {plan.describe()}")
    terms = {t.name: t.plan_terms(cfg, a.batch, a.seq) for t in targets}
    here = terms.get(jax.default_backend()) or Target(jax.default_backend()).plan_terms(cfg, a.batch, a.seq)
    for t in targets:
        # The plan as the engine on that platform prices it: the traced terms swapped in
        # (a recompute group of one block: one block's residuals and working bytes).
        total = plan.total + sum(terms[t.name][k] - here[k] for k in ("residuals", "working", "head"))
        print(f"plan terms traced for {t.name}: " + ", ".join(f"{k} {mib(v)}" for k, v in terms[t.name].items())
              + f"; device plan with them {mib(total)}")
    names = [t.name for t in targets]
    print("| program | " + " | ".join(f"{n} temp | {n} args | {n} new out | {n} plan term" for n in names) + " |")
    print("|---|" + "---|---|---|---|" * len(names))
    for name, (fn, args, donate) in programs(cfg, a.batch, a.seq).items():
        cells = []
        for t in targets:
            try:
                m = t.compile(fn, args, donate)
                out = m.output_size_in_bytes - m.alias_size_in_bytes  # a donated argument's is no new buffer
                cells += [mib(m.temp_size_in_bytes), mib(m.argument_size_in_bytes), mib(out)]
            except Exception as e:  # a kernel the deviceless compile cannot build: say which
                print(f"{name} on {t.name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}", file=sys.stderr)
                cells += ["failed", "", ""]
            cells.append(PRICED[name](terms[t.name], mib))
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
