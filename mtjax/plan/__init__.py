"""The planner: what one training step of the streaming engine costs on a machine.

    hardware  profiles (built-in vendor figures, or measured by `probe`)
    probe     measures this machine: disk, memory, matmul, host<->device link
    machine   this machine's profile: a quick probe, cached per machine
    cost      bytes, FLOPs and seconds of one step, from `mtjax.parts.schema`
    fit       does it fit (`check`, for the trainer's preflight), the placement table, what to change
    wholerun  a whole run: wall time, device-hours, price, bytes written against the drive's endurance
    inputs    a model and workload from an HF config.json, a checkpoint dir or an experiment YAML
    report    the plan as text or JSON (numbers as text: `units`)

    plan = estimate(cfg, Workload(batch_size=1, seq_len=4096), load("h200"))
    problem = check(plan, available_ram, free_disk)  # None when the run fits
"""

from mtjax.plan.cost import Placement, Plan, Workload, estimate, part_bytes
from mtjax.plan.fit import Advice, check, recommend
from mtjax.plan.hardware import BUILTIN, HardwareError, HardwareProfile, load

__all__ = [
    "BUILTIN", "Advice", "HardwareError", "HardwareProfile", "Placement", "Plan", "Workload",
    "check", "estimate", "load", "part_bytes", "recommend",
]
