"""The environment a command starts in: variables that choose JAX's platform and device
count, and the ones mtjax reads itself (counts, and MTJAX_PROGRESS's one value).

`check` runs in `mtjax.cli.main` before any command module (and so JAX) is imported: a
count that is not a whole number, or asks for no devices, or a variable of mtjax's with a
value it does not know, is one line naming the variable (JAX itself reads some of them when it is imported and raises a ValueError
there, or XLA aborts the process with its whole flag list). `backend_failure` words an
exception raised while JAX starts its backend, which is where a platform that is not
there shows itself (JAX_PLATFORMS=cuda or tpu on a machine without one, or with
CUDA_VISIBLE_DEVICES hiding every GPU): JAX raises a RuntimeError or fails an assertion
then, depending on the platform, so the exception is recognised by where it was raised.
"""

from __future__ import annotations

import os
import re
import traceback

from mtjax.errors import MtjaxError


class EnvironmentProblem(MtjaxError):
    """An environment variable that cannot be meant; the message names it and what to do."""


# Variables holding a count, and the least value that means something.
_COUNTS = {
    "JAX_NUM_CPU_DEVICES": 1,  # read by JAX when it is imported
    "PJRT_NPROC": 1,  # read by XLA's CPU client (mtjax.cpu_pool sets it)
    "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": 1,  # read by mtjax.stream.staging
    "SLURM_NTASKS": 1,  # read by mtjax.distributed
}
# Variables of mtjax's that take one of a few words.
_WORDS = {
    "MTJAX_PROGRESS": ("always",),  # read by mtjax.terminal
}
_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count(?:=(\S*))?")


def _count(value: str, least: int) -> bool:
    value = value.strip()
    return value.lstrip("-").isdigit() and value.isascii() and int(value) >= least


def check(environ=os.environ) -> None:
    """Raise EnvironmentProblem for the first variable that cannot be meant."""
    for name, least in _COUNTS.items():
        value = environ.get(name)
        if value is not None and value.strip() and not _count(value, least):
            raise EnvironmentProblem(f"environment variable {name}={value!r} must be a whole number >= {least}; "
                                     f"set it to one, or unset it")
    for name, words in _WORDS.items():
        value = environ.get(name)
        if value is not None and value.strip() and value.strip() not in words:
            raise EnvironmentProblem(f"environment variable {name}={value!r} is not one of: {', '.join(words)}; "
                                     f"set it to one, or unset it")
    for m in _DEVICE_COUNT_FLAG.finditer(environ.get("XLA_FLAGS", "")):
        if m.group(1) is None or not _count(m.group(1), 1):
            raise EnvironmentProblem(f"XLA_FLAGS has {m.group(0)!r}: the CPU device count must be a whole number "
                                     ">= 1, e.g. --xla_force_host_platform_device_count=2; fix or remove it")


def backend_failure(e: BaseException, environ=os.environ) -> str | None:
    """One line for an exception JAX raised while starting its backend; None for any other."""
    frames = traceback.extract_tb(e.__traceback__)
    if not any(f.filename.endswith(os.path.join("jax", "_src", "xla_bridge.py")) for f in frames):
        return None
    platforms = environ.get("JAX_PLATFORMS", "")
    reason = str(e).split(" (set JAX_PLATFORMS=")[0].strip().splitlines()
    reason = f" ({reason[0]})" if reason else ""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    hidden = f" (or CUDA_VISIBLE_DEVICES={visible!r} hides it)" if visible is not None else ""
    if platforms:
        return (f"JAX could not start the platform JAX_PLATFORMS={platforms!r} asks for{reason}; this machine may "
                f"not have it{hidden}: set JAX_PLATFORMS=cpu, or unset it to use what there is, or install the "
                "platform's JAX plugin")
    return (f"JAX could not start its backend{reason}; check the device settings in the environment "
            "(CUDA_VISIBLE_DEVICES, XLA_FLAGS) or set JAX_PLATFORMS=cpu")
