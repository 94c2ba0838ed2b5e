"""The planner: what one training step of the streaming engine costs on a machine.

    hardware  profiles (built-in vendor figures, or measured by `probe`)
    probe     measures this machine: disk, memory, matmul, host<->device link
    machine   this machine's profile: a quick probe, cached per machine
    cost      the step's schedule (mtjax.stream.schedule) priced: FLOPs, footprints, seconds
    fit       does it fit (`check`, for the trainer's preflight), the placement table, what to change
    longest   the longest row (sequence length) that fits a machine
    wholerun  a whole run: wall time, device-hours, price, bytes written against the drive's endurance
    inputs    a model and its run settings from an HF config.json, a checkpoint dir or an experiment YAML
    report    the plan as text or JSON (numbers as text: mtjax.units)

    plan = estimate(cfg, StreamConfig(), StoreConfig(), StepShape(batch=1, seq=4096), load("h200"))
    problem = check(plan, available_ram, free_disk)  # None when the run fits
"""

from mtjax.plan.cost import Plan, estimate
from mtjax.plan.fit import Advice, check, recommend
from mtjax.plan.hardware import BUILTIN, HardwareError, HardwareProfile, load
from mtjax.stream.step_bytes import StepShape

__all__ = [
    "BUILTIN", "Advice", "HardwareError", "HardwareProfile", "Plan", "StepShape",
    "check", "estimate", "load", "recommend",
]
