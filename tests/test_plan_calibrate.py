"""The planner's calibrated terms: XLA's 4-pass optimizer, block-measured compute, runtime RSS."""

import dataclasses
import json

import pytest

from mtjax.config import StoreConfig, StreamConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.plan import BUILTIN, StepShape, estimate, hardware, probe

from conftest import tiny_config

CFG = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=128, head_dim=16, compute_dtype="bfloat16")
TX = make_optimizer(OptimConfig())
CPU = BUILTIN["cpu-2core"]
SHAPE = StepShape(batch=1, seq=32)


def plan_of(hw=CPU, fused=None):
    return estimate(CFG, StreamConfig(), StoreConfig(), SHAPE, hw, tx=TX, fused=fused)


@pytest.mark.parametrize("fused", [True, False])
def test_optimizer_priced_as_the_engine_runs_it(fused):
    plan = plan_of(fused=fused)
    n = plan.num_params
    embed = plan.part_bytes["embed"].master // 4  # its gradient arrives in fp32; the others in bf16
    # Each part staged: master rounded into the slot without a compute copy (6 bytes/param)
    # or the copy copied in (4); the transfers are embed, 2 blocks, head, 1 block (k = 1).
    staged = sum(plan.part_bytes[p].master // 4 for p in plan.schedule.transfers)
    if fused:  # one loop: master 8, mu and nu 16, gradient 2 (bf16, read as it is) or 4; no compute copy
        extra = 2 * (plan.state.opt - 8 * n)  # AdamW's step counters ride along
        grads = 2 * plan.traffic.d2h  # the loop's read, and the device's norm's (host memory on the CPU)
        assert plan.traffic.host_memory == 24 * n + extra + grads + 6 * staged
    else:  # XLA's passes: mu, nu 12 bytes each; master 16; bf16 copy 6
        # The device's norm reads each gradient as computed; a bf16 one is widened (read 2, write 4).
        grads = plan.traffic.d2h + 6 * (n - embed)
        extra = 3 * (plan.state.opt - 8 * n)
        assert plan.traffic.host_memory == 46 * n + extra + grads + 4 * staged
    assert 0 <= extra < 1000  # a few int32 counts per part


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("hw", ["cpu-2core", "h200"])
def test_gradient_priced_where_the_engine_handles_it(hw, accum):
    """Each gradient's squared norm is reduced on the device (mtjax.stream.grads): host
    memory only where the device is the host, which reads it once as computed. A GPU's
    gradient is copied out of its transfer buffer instead (read + write). The fused loop
    reads it as it arrives (bf16 alone, fp32 summed), and nothing else touches it."""
    stream = StreamConfig(resident="none")
    plan = estimate(CFG, stream, StoreConfig(), StepShape(1, 32, accum), BUILTIN[hw], tx=TX, fused=True)
    t, n = plan.schedule.traffic, plan.num_params  # host CPU bytes (the plan adds a GPU's DMA)
    g = t.d2h_grads
    assert g == (4 * n if accum > 1 else 2 * n + plan.part_bytes["embed"].master // 2)  # embed's is fp32
    extra = 2 * (plan.state.opt - 8 * n)
    staged = sum(plan.part_bytes[p].master // 4 for p in plan.schedule.transfers)
    norm_or_copy = g if hw == "cpu-2core" else 2 * g
    assert t.host_memory == 24 * n + extra + g + norm_or_copy + 6 * staged


def test_calibrate_sets_efficiency_from_the_measured_block():
    cal = probe.calibrate(CPU, CFG, 1, 32, achieved=50e9)
    assert cal.matmul_flops("bfloat16") == pytest.approx(50e9)
    assert cal.matmul_flops_bf16 == CPU.matmul_flops_bf16  # only the efficiency changes
    slow, fast = plan_of(cal), plan_of(CPU)
    assert slow.times.device == pytest.approx(slow.flops / 50e9)
    assert slow.times.device > fast.times.device


def test_block_flops_runs_the_engine_block():
    flops = probe.block_flops(CFG, 1, 16, repeats=1)
    assert 1e6 < flops < 1e15


def test_runtime_bytes_enters_host_memory(tmp_path):
    small, big = plan_of(dataclasses.replace(CPU, runtime_bytes=300 << 20)), plan_of(CPU)
    assert small.host.runtime == 300 << 20
    assert big.host.total - small.host.total == (2 << 30) - (300 << 20)
    # a profile written before the field existed still loads, with the 2 GiB default
    fields = dataclasses.asdict(CPU)
    del fields["runtime_bytes"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(fields))
    assert hardware.load(path).runtime_bytes == 2 << 30
