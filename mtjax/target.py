"""The platform a program is being traced for, where code picks a platform's tuning at
trace time.

`jax.lax.platform_dependent` would defer the choice to lowering, but under autodiff a
`switch` keeps the residuals of every branch (the others' as zeros): a block's vjp
residuals, which a recompute group holds across programs, doubled under the "dots"
policy on the CPU (0.98 -> 1.90 MB, 2-block toy). So the choice is made while tracing,
from the platform of the devices the program is for: the abstract mesh's in context
(`jax.set_mesh`, or `jax.sharding.use_abstract_mesh` for a program lowered for another
platform without its devices), else the default backend's.
"""

from __future__ import annotations

import jax


def platform() -> str:
    """"cpu", "gpu" (JAX's name for its CUDA and ROCm devices), "cuda", "tpu", ... of the
    program being traced (see the module's docstring)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()
