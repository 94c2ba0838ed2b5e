"""Data parallel over two CPU devices equals one device and the reference trainer, and
moves what the step's description says.

One child process with two CPU devices runs every case (tests/multidevice_cases.py:
5 AdamW steps with clipping, RAM and disk tiers, accum 1 and 4, activations on the
device and in host memory, a tied embedding and resident parts); this test asserts on
what it reports. Per tensor ||a - b|| / ||b|| <= 1e-5 in fp32, as tests/test_stream.py.
"""

from __future__ import annotations

import dataclasses

import pytest

import multidevice
import multidevice_cases
from mtjax.config import ConfigError, DataConfig, ExperimentConfig, StoreConfig, StreamConfig
from mtjax.plan import BUILTIN, StepShape, estimate

TOL = 1e-5


@pytest.fixture(scope="module")
def results():
    return multidevice.run(["tests/multidevice_cases.py"], devices=2, timeout=600)


CASES = ["ram-accum1", "disk-accum4-host-activations", "ram-accum4-tied-resident"]


@pytest.mark.parametrize("name", CASES)
def test_two_devices_train_as_the_reference_does(results, name):
    r = results[name]
    assert r["devices"] == r["schedule_devices"] == 2
    assert r["clipped"]  # every step's norm is over clip_norm: the clip scale is exercised
    assert r["vs_reference"] <= TOL, r["vs_reference"]
    assert r["loss_error"] <= 1e-5 and r["norm_error"] <= 1e-5, (r["loss_error"], r["norm_error"])
    if "vs_one_device" in r:
        assert r["one_device"] == 1 and r["vs_one_device"] <= TOL, r["vs_one_device"]
        assert r["eval_error"] <= 1e-5, r["eval_error"]  # evaluation over both devices too


@pytest.mark.parametrize("name", CASES)
def test_two_devices_move_what_the_schedule_says(results, name):
    r = results[name]
    # Every transfer, gradient, all-reduce, disk and spill byte, measured, equals the description.
    assert r["moved"] == r["described"]
    # Each device gets a whole copy of each staged part: twice one device's bytes.
    assert r["moved"]["h2d_weights"] == 2 * r["one_copy_per_device"]
    if "one_device_h2d_weights" in r:
        assert 5 * r["one_device_h2d_weights"] == r["one_copy_per_device"]
    # Hidden states stay split over the devices; gradients come out of their programs
    # summed over both (replicated) and leave from one device only.
    assert r["seen"] == {"hidden": ["split"], "grads_made": ["replicated"], "grads_out": ["one"]}
    assert r["allreduce_parts"] == ["block.0", "block.1", "embed", "head"]
    # The ledger held each device's share to the per-device plan; the planner prices it.
    assert r["peak"]["activations"] == r["device_plan"]["activations"]
    assert r["peak"]["resident"] == r["device_plan"]["resident"]
    assert r["peak"]["weights"] <= r["device_plan"]["weights"]
    assert r["planner_agrees"] and r["planner_interconnect_s"] > 0


def test_device_count_mistakes_are_one_line(results):
    bad = results["bad_inputs"]
    assert bad["too_many"] == ("stream.devices is 3 but this process has 2 cpu device(s): "
                               "set stream.devices to at most 2, or to all")
    assert bad["odd_batch"].startswith("data.batch_size 3 does not split over 2 devices (stream.devices)")
    with pytest.raises(ConfigError, match="data.batch_size 6 does not split over 4 devices"):
        ExperimentConfig(stream=StreamConfig(devices=4), data=DataConfig(batch_size=6))
    with pytest.raises(ConfigError, match="stream.devices must be all or a device count >= 1"):
        StreamConfig(devices=0)
    assert dataclasses.replace(ExperimentConfig(), stream=StreamConfig(devices=2)).stream.devices == 2


def test_a_replicated_put_aliases_the_staging_buffer_on_the_cpu(results):
    """As the schedule and docs/parallel.md say: each device's copy is counted, and on the
    CPU backend each is the staging buffer itself (so the fence rule covers both)."""
    assert results["replicated_put"] == {"copies": 2, "aliased": [True, True]}


def test_pinned_staging_over_two_devices(results):
    """The GPU's path through pinned host memory, forced on the CPU devices."""
    assert results["pinned_path"] == {"pinned": True, "weights": "replicated", "copies_equal": True,
                                      "activations": "split", "activations_equal": True,
                                      "grads": "one", "grads_equal": True}


def test_the_description_and_its_price_scale_with_the_devices():
    """Two devices: a copy of the weights each, the same gradients out, each device's
    share of the rows on it and of the FLOPs, and an all-reduce that one device has not."""
    shape = StepShape(multidevice_cases.BATCH, multidevice_cases.SEQ, 2)
    one, two = (estimate(multidevice_cases.CFG, StreamConfig(resident="none"), StoreConfig(), shape, BUILTIN["h200"],
                         devices=n) for n in (1, 2))
    t1, t2 = one.schedule.traffic, two.schedule.traffic
    assert (one.schedule.devices, two.schedule.devices) == (1, 2)
    assert t2.h2d_weights == 2 * t1.h2d_weights and t2.h2d_tokens == t1.h2d_tokens and t2.d2h == t1.d2h
    assert one.schedule.allreduce == {} and t1.allreduce == 0 and one.times.interconnect == 0
    assert t2.allreduce == sum(two.schedule.allreduce.values()) == 2 * sum(
        b.master if p == "embed" else b.compute for p, b in two.part_bytes.items())  # accum 2, fp32 here
    assert two.times.interconnect == pytest.approx(t2.allreduce / BUILTIN["h200"].interconnect_bytes_per_s)
    assert two.device.weights == one.device.weights and 2 * two.device.activations == one.device.activations
    assert two.times.device == pytest.approx(one.times.device / 2)
