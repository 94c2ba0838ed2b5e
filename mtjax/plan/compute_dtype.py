"""model.compute_dtype=auto: bf16 compute where the hardware runs it faster than fp32.

Like stream.resident=auto (mtjax.plan.residency), `auto` is resolved when a run or
`mtjax plan` starts, for the hardware profile it plans for:

    accelerator   bfloat16 (its matmul units are bf16's)
    CPU           bfloat16 where the profile's bf16 matmul rate is at least MARGIN times
                  its fp32 rate (AVX-512 BF16 or AMX), else float32

The profile of a run on the CPU is this machine's quick probe, cached
(mtjax.plan.machine); `mtjax plan` uses the profile it plans for. Master weights and
optimizer state stay fp32 either way. A run records the resolved dtype, not `auto`: its
store's model config (which a resume must match, mtjax.store.checks) and its
config.yaml. docs/cpu.md has the measurements behind MARGIN.
"""

from __future__ import annotations

import dataclasses

import jax

from mtjax.plan import machine
from mtjax.plan.hardware import HardwareProfile

AUTO = "auto"
# bf16 over fp32 matmul rate from which a CPU computes in bf16. A bf16 block forward +
# backward gains less than the matmuls do (norms, softmax, the loss stay fp32): on AMD
# Zen 4 (AVX-512 BF16) matmuls 1.9x, a block forward + backward 1.7x; a CPU without bf16 instructions
# converts to fp32 and gains nothing.
MARGIN = 1.2


def choose(hw: HardwareProfile) -> tuple[str, str]:
    """(compute dtype, why: a short clause) that `auto` resolves to on `hw`."""
    if not hw.device_is_host:
        return "bfloat16", f"an accelerator ({hw.device}) computes in bf16"
    ratio = hw.matmul_flops_bf16 / hw.matmul_flops_fp32
    rates = f"{hw.name}'s bf16 matmul runs {ratio:.2f}x its fp32"
    if ratio >= MARGIN:
        return "bfloat16", f"{rates} (>= {MARGIN}x)"
    return "float32", f"{rates} (< {MARGIN}x)"


def asks_auto(overrides) -> bool:
    """Whether model overrides (a mapping or ModelSection.overrides' pairs) set compute_dtype auto."""
    return dict(overrides).get("compute_dtype") == AUTO


def resolve(exp, hw: HardwareProfile):
    """(experiment with model.compute_dtype=auto replaced by `choose`'s dtype for `hw`, one
    line saying which and why); settings given are kept, with None for the line."""
    return _resolved(exp, *choose(hw)) if asks_auto(exp.model.overrides) else (exp, None)


def widest(exp):
    """The experiment with auto replaced by float32, the widest dtype it may resolve to: for
    what must be sized before a JAX backend starts (a GPU's pinned host pool, whose cap is
    only ever raised), which `for_run` would start."""
    return _resolved(exp, "float32", "")[0] if asks_auto(exp.model.overrides) else exp


def here() -> tuple[str, str]:
    """`choose` for this process's device: bfloat16 on an accelerator, else as this
    machine's cached quick probe says (measured now on first use)."""
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        return "bfloat16", f"an accelerator ({device.device_kind}) computes in bf16"
    return choose(machine.profile().profile)


def for_run(exp):
    """`resolve` for this process's device (`here`)."""
    return _resolved(exp, *here()) if asks_auto(exp.model.overrides) else (exp, None)


def describe(dtype: str, why: str) -> str:
    """The one line a run and `mtjax plan` print of what auto chose."""
    return f"compute dtype {dtype} (model.compute_dtype=auto: {why})"


def _resolved(exp, dtype: str, why: str):
    overrides = tuple((k, dtype if k == "compute_dtype" else v) for k, v in exp.model.overrides)
    return dataclasses.replace(exp, model=dataclasses.replace(exp.model, overrides=overrides)), describe(dtype, why)
