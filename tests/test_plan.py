"""The planner: byte counts agree with mtjax.parts.schema, FLOPs agree with XLA, big
models plan without allocating, `check` explains shortfalls, and the CLI runs."""

import dataclasses
import json
import math
from pathlib import Path

import jax
import numpy as np
import optax
import psutil
import pytest
from flax import nnx

from mtjax import cli, hf, lora, model, parts, treepath
from mtjax.model_config import from_hf_dict, load_hf_config
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.config import StoreConfig, StreamConfig
from mtjax.plan import (BUILTIN, HardwareError, StepShape, check, compute_dtype, estimate, hosts, load, recommend,
                        residency)
from mtjax.plan.cost import block_forward_flops
from mtjax.plan.report import size
from mtjax.shard import Shard
from mtjax.stream import block_bytes, fused_adamw, step_bytes
from mtjax.stream.block_bytes import residual_bytes

from conftest import tiny_config, tiny_moe_config

ROOT = Path(__file__).resolve().parent.parent
BIG = [ROOT / "experiments/hf_configs/llama-3-70b.json", ROOT / "experiments/hf_configs/llama-175b.json",
       ROOT / "experiments/hf_configs/phi-4.json"]
BIG_PARAMS = {"llama-3-70b": 70.6e9, "llama-175b": 175.2e9, "phi-4": 14.66e9}
CFG = tiny_config(vocab_size=97, intermediate_size=56, num_hidden_layers=3, compute_dtype="bfloat16")
TX = make_optimizer(OptimConfig())
HW = BUILTIN["h200"]


def plan_of(cfg=CFG, shape=StepShape(1, 2048), hw=HW, tx=TX, **knobs):
    """The plan of `cfg` at `shape` with stream.* and store.* knobs given by name."""
    stream = {k: v for k, v in knobs.items() if k in ("keep_every", "prefetch_depth", "activations")}
    store = {k: v for k, v in knobs.items() if k not in stream}
    return estimate(cfg, StreamConfig(**stream), StoreConfig(**store), shape, hw, tx=tx)


def schema_total(cfg, kind, names=None):
    names = names or [p.name for p in parts.parts(cfg)]
    return sum(parts.nbytes(parts.schema(cfg, n, kind, TX)) for n in names)


def test_state_and_link_bytes_are_sums_over_the_schema():
    shape = StepShape(batch=2, seq=16, accum=3)
    plan = plan_of(shape=shape)
    compute, master, opt = (schema_total(CFG, k) for k in parts.KINDS)
    assert (plan.state.compute, plan.state.master, plan.state.opt) == (compute, master, opt)
    assert plan.num_params == model.num_params(CFG)
    blocks = schema_total(CFG, "compute", [f"block.{i}" for i in range(3)])
    embed, head = (schema_total(CFG, "compute", [n]) for n in ("embed", "head"))
    tokens = 3 * 2 * 16 * 4  # int32 ids of three micro-batches
    # Once per step, whatever the accum: every part forward, the blocks again backward,
    # except the last, which stays on the device (k = 1).
    assert plan.traffic.h2d == 2 * blocks - blocks // 3 + embed + head + tokens
    # Each part's gradient leaves once, summed over the micro-batches in fp32.
    assert plan.traffic.d2h == master
    one = plan_of(shape=StepShape(2, 16, 1))
    # One micro-batch: in the compute dtype, except the embedding's dense fp32 table.
    assert one.traffic.d2h == blocks + head + schema_total(CFG, "master", ["embed"])
    # With master and compute in RAM the engine keeps no compute copy (the fused update).
    assert plan.schedule.derived_compute == fused_adamw.supports(CFG.compute_dtype)
    assert plan.host.state == master + opt + (0 if plan.schedule.derived_compute else compute)
    assert plan_of(shape=shape, compute="disk").host.state == master + opt
    assert plan.host.grads == master
    assert plan.traffic.disk_read == plan.traffic.disk_write == 0


def test_disk_tier_moves_its_bytes_from_ram_to_disk():
    shape = StepShape(1, 2048, accum=2)
    base = plan_of(shape=shape)
    master, opt = schema_total(CFG, "master"), schema_total(CFG, "opt")
    opt_disk = plan_of(shape=shape, opt="disk")
    assert base.host.state - opt_disk.host.state == opt
    assert opt_disk.traffic.disk_read == opt_disk.traffic.disk_write == opt
    # Two copies on disk (crash-safe commit); a checkpoint writes every RAM-resident kind into
    # the run's store, the compute copy included.
    compute = schema_total(CFG, "compute")
    assert opt_disk.disk_bytes == base.disk_bytes == 2 * (compute + master + opt)
    # Master weights on disk: the engine spills each part's fp32 gradient sum (master-sized)
    # once per step, and reads it back for the update.
    both = plan_of(shape=shape, master="disk", opt="disk")
    # Beside RAM master weights no compute copy is kept (fused update); beside disk ones it is.
    kept = 0 if base.schedule.derived_compute else compute
    assert base.host.state - both.host.state == master + opt + kept - compute
    assert base.host.grads == master and both.host.grads == 0
    assert both.traffic.disk_read == both.traffic.disk_write == master + opt + master
    all_disk = plan_of(compute="disk", master="disk", opt="disk")
    # Every part staged to the device is read from the store, but for its first staging of
    # the step, which takes the copy its update wrote (every part once); the update writes it.
    assert all_disk.traffic.disk_read == master + opt + master + all_disk.traffic.h2d - 2048 * 4 - compute
    assert all_disk.traffic.disk_write == master + opt + master + compute


def test_block_flops_match_xla_cost_analysis():
    cfg = dataclasses.replace(CFG, hidden_size=128, intermediate_size=352, head_dim=32, compute_dtype="float32")
    b, s = 2, 64
    w = parts.schema(cfg, "block.0", "compute")
    template = parts.abstract_part(cfg, "block.0")
    x = jax.ShapeDtypeStruct((b, s, cfg.hidden_size), np.float32)
    fn = jax.jit(lambda w, x: model.block_forward(cfg, cfg.layer_specs[0], treepath.unflatten(template, w), x))
    xla = fn.lower(w, x).compile().cost_analysis()["flops"]
    ours = block_forward_flops(cfg, cfg.layer_specs[0], sum(math.prod(v.shape) for v in w.values()), b, s)
    assert ours == pytest.approx(xla, rel=0.03)


def test_device_peak_grows_with_prefetch_depth_and_kept_inputs_shrink_with_k():
    shape = StepShape(batch=2, seq=32)
    peaks = [plan_of(shape=shape, prefetch_depth=d).device.total for d in (1, 2, 4)]
    assert peaks[0] < peaks[1] < peaks[2]
    plans = [plan_of(shape=shape, keep_every=k).device for k in (1, 2, 3)]
    hidden = 2 * 32 * CFG.hidden_size * 2  # [batch, seq, hidden] bf16
    assert [p.activations for p in plans] == [3 * hidden, 2 * hidden, hidden]
    assert plans[0].residuals < plans[1].residuals < plans[2].residuals  # k blocks of residuals
    host = plan_of(shape=shape, activations="host")
    assert host.device.activations == 0 and host.host.activations == plans[0].activations
    # All micro-batches' kept inputs wait at once, between the forward and the backward.
    assert plan_of(shape=StepShape(2, 32, 4), keep_every=1).device.activations == 4 * plans[0].activations


@pytest.mark.slow  # runs the probe / a real vjp
def test_residuals_are_what_a_real_vjp_keeps():
    b, s = 2, 16
    params = model.init_params(CFG)["blocks"][0]
    w = treepath.flatten(model.cast(params, CFG.compute_dtype))
    x = jax.numpy.ones((b, s, CFG.hidden_size), CFG.compute_dtype)
    template = parts.abstract_part(CFG, "block.0")
    _, vjp = jax.vjp(lambda w, x: model.block_forward(CFG, CFG.layer_specs[0], treepath.unflatten(template, w), x), w, x)
    def is_weight(leaf):  # the weights are held anyway (possibly as a new array object)
        return any(v.shape == leaf.shape and v.dtype == leaf.dtype and bool((v == leaf).all()) for v in w.values())

    kept = sum(leaf.nbytes for leaf in jax.tree.leaves(vjp) if not is_weight(leaf))
    assert kept > 0
    assert residual_bytes(CFG, CFG.layer_specs[0], b, s) == kept


@pytest.mark.parametrize("path", BIG, ids=lambda p: p.stem)
def test_big_configs_plan_without_allocating(path):
    rss = psutil.Process().memory_info().rss
    cfg = load_hf_config(path, compute_dtype="bfloat16")
    plan = estimate(cfg, StreamConfig(), StoreConfig(), StepShape(1, 2048), HW)
    advice = recommend(plan)
    assert psutil.Process().memory_info().rss - rss < 512 * 2**20  # the bf16 weights alone are > 25 GiB
    assert plan.num_params == pytest.approx(BIG_PARAMS[path.stem], rel=0.01)
    assert plan.state.master == 4 * plan.num_params
    assert plan.times.step > 0 and plan.times.bound in ("device compute", "host<->device link", "disk", "host memory")
    assert advice.fits and advice.plan.host.total <= HW.host_ram_bytes


def test_check_names_the_ram_shortfall_and_a_placement_that_fits():
    cfg = dataclasses.replace(CFG, vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=8,
                              layer_types=(), num_attention_heads=8, head_dim=32)
    plan = plan_of(cfg)
    assert check(plan, available_ram=plan.host.total, free_disk=plan.disk_bytes) is None
    short = schema_total(cfg, "opt") // 2
    message = check(plan, available_ram=plan.host.total - short, free_disk=10**12)
    assert "host RAM" in message and f"short by {size(short)}" in message
    # The suggested change moves one kind of state to disk, and then the run fits.
    suggested = message.split(": set ")[1].split()
    assert len(suggested) == 1 and suggested[0].startswith("store.") and suggested[0].endswith("=disk")
    kind = suggested[0].removeprefix("store.").split("=")[0]
    fixed = plan_of(cfg, **{kind: "disk"})
    assert check(fixed, available_ram=plan.host.total - short, free_disk=10**12) is None
    assert "free disk" in check(plan, available_ram=plan.host.total, free_disk=plan.disk_bytes - 1)
    assert "device memory" in check(plan, plan.host.total, plan.disk_bytes, device_memory=plan.device.total - 1)


def test_recommend_puts_state_on_disk_only_when_ram_is_short():
    # Twelve blocks: the disk tier's read buffers and writes in flight cost about three
    # blocks' state, so with three blocks state on disk would need no less RAM.
    deep = tiny_config(vocab_size=97, intermediate_size=56, num_hidden_layers=12, compute_dtype="bfloat16")
    plan = plan_of(deep, hw=BUILTIN["cpu-2core"])
    assert recommend(plan).placement == StoreConfig()
    # RAM for the plan with the optimizer state on disk (its read buffers and writes in
    # flight included), not for the all-RAM one.
    tight = plan_of(deep, hw=BUILTIN["cpu-2core"], opt="disk").ram_needed
    assert tight < plan.ram_needed
    advice = recommend(plan, available_ram=int(tight / 0.9))
    assert advice.fits and advice.placement != StoreConfig()
    assert advice.plan.ram_needed <= tight


def test_recommended_prefetch_depth_fits_host_ram_too():
    # A deeper prefetch stages more in host RAM: with RAM for depth 1 only, depth 1 is advised.
    one, two = plan_of(prefetch_depth=1), plan_of(prefetch_depth=2)
    assert two.ram_needed > one.ram_needed
    assert recommend(one, available_ram=int(two.ram_needed / 0.9) + 1).prefetch_depth == 2
    advice = recommend(one, available_ram=int(one.ram_needed / 0.9) + 1)
    assert advice.fits and advice.prefetch_depth == 1 and advice.placement == StoreConfig()


def test_on_a_cpu_device_the_device_peak_counts_as_host_ram():
    plan = plan_of(shape=StepShape(2, 32), hw=BUILTIN["cpu-2core"])
    assert plan.ram_needed == plan.host.total + plan.device.total
    assert check(plan, available_ram=plan.ram_needed, free_disk=plan.disk_bytes) is None
    assert "host RAM" in check(plan, available_ram=plan.host.total, free_disk=plan.disk_bytes)


def test_a_host_of_several_counts_the_compute_copy_once_and_the_slots_it_stages_into():
    """One host of a run of two (mtjax.plan.hosts) is priced from the schedule of a process
    of two: the compute copy kept (counted once: the one-host plan, fused fp32 in RAM,
    keeps none), every part staged into a slot (on the CPU too, where one host stages in
    place), less the other host's rows of master, optimizer state and gradient sums."""
    cfg, shard = dataclasses.replace(CFG, compute_dtype="float32"), Shard(0, 2)
    mine = sum(parts.nbytes(shard.schema(parts.schema(cfg, p.name, "master", TX))) for p in parts.parts(cfg))
    mine_opt = sum(parts.nbytes(shard.schema(parts.schema(cfg, p.name, "opt", TX))) for p in parts.parts(cfg))
    for hw in (HW, BUILTIN["cpu-2core"]):
        one = plan_of(cfg=cfg, shape=StepShape(2, 16), hw=hw)
        two = hosts.of_processes(one, 2)
        assert one.schedule.derived_compute and not two.schedule.derived_compute and not two.schedule.in_place
        assert bool(one.schedule.in_place) == hw.device_is_host == (one.host.slots == 0)
        alone = estimate(cfg, StreamConfig(), StoreConfig(), StepShape(1, 16), hw, tx=TX)  # a process's rows
        assert two.ram_needed == alone.ram_needed + alone.state.compute + two.host.slots - alone.host.slots
        others = (one.state.master - mine) + (one.state.opt - mine_opt) + one.host.grads * (one.state.master - mine) \
            // one.state.master
        want = two.ram_needed - others
        assert hosts.per_host(one, 2).ram_bytes == want
        assert hosts.host_plan(one, 2).ram_needed == want and hosts.host_plan(one, 2).schedule == two.schedule


def test_a_host_of_several_is_told_the_smallest_move_to_disk_that_fits_its_share():
    """A RAM-short host of a run of two (hosts.host_plan) is told what to move to disk by
    placements priced as that host's share too: priced as one process holding the whole
    state, no single kind moved fitted, and it was told to move two."""
    deep = tiny_config(vocab_size=97, intermediate_size=56, num_hidden_layers=12, compute_dtype="bfloat16")
    host = hosts.host_plan(plan_of(deep, shape=StepShape(2, 2048)), 2, TX)
    opt_on_disk = hosts.host_plan(estimate(deep, host.stream, StoreConfig(opt="disk"), host.shape, HW, tx=TX,
                                           processes=2), 2, TX)
    assert opt_on_disk.ram_needed < host.ram_needed
    problem = check(host, available_ram=opt_on_disk.ram_needed, free_disk=10**15, tx=TX)
    told = problem.rsplit(": set ", 1)[-1].split()
    assert len(told) == 1 and told[0].startswith("store.") and told[0].endswith("=disk"), problem
    kind = told[0].removeprefix("store.").removesuffix("=disk")
    followed = hosts.host_plan(estimate(deep, host.stream, StoreConfig(**{kind: "disk"}), host.shape, HW, tx=TX,
                                        processes=2), 2, TX)
    assert followed.ram_needed <= opt_on_disk.ram_needed


def test_a_host_of_several_steps_its_share_of_the_batch():
    """Each process trains its rows of every micro-batch (mtjax.stream.hosts.share): one
    host's step, device peak and time, is that of its rows, not of the whole batch; a batch
    the processes cannot split equally is one line."""
    for hw in (HW, BUILTIN["cpu-2core"]):
        one = plan_of(shape=StepShape(4, 64, 2), hw=hw)
        two = hosts.of_processes(one, 2)
        rows = estimate(CFG, StreamConfig(), StoreConfig(), StepShape(2, 64, 2), hw, tx=TX, processes=2)
        assert two.shape == StepShape(2, 64, 2) and two.schedule == rows.schedule and two.times == rows.times
        assert two.device.activations < one.device.activations and two.flops == pytest.approx(one.flops / 2)
        h = hosts.per_host(one, 2)
        assert h.step_s == two.times.step + h.network_s < one.times.step + h.network_s
    with pytest.raises(ValueError, match="data.batch_size 4 must be a multiple of the number of processes \\(3\\)"):
        hosts.per_host(plan_of(shape=StepShape(4, 64)), 3)


def test_a_host_of_several_keeps_rows_of_the_run_s_optimizer_state():
    """Per host, the optimizer state is the rows of the one the plan was priced with: SGD
    with momentum keeps one moment, AdamW two. The default (AdamW) against a plan of
    another optimizer is an error, not a wrong price."""
    sgd, shard = optax.sgd(1e-3, momentum=0.9), Shard(0, 2)
    plan = plan_of(shape=StepShape(2, 16), tx=sgd)
    assert 0 < plan.state.opt < plan_of(shape=StepShape(2, 16)).state.opt

    mine = {k: sum(parts.nbytes(shard.schema(parts.schema(CFG, p.name, k, sgd))) for p in parts.parts(CFG))
            for k in ("master", "opt")}
    two = hosts.of_processes(plan, 2)
    grads = plan.host.grads - plan.host.grads * mine["master"] // plan.state.master
    want = two.ram_needed - (plan.state.master - mine["master"]) - (plan.state.opt - mine["opt"]) - grads
    assert hosts.per_host(plan, 2, sgd).ram_bytes == hosts.host_plan(plan, 2, sgd).ram_needed == want
    with pytest.raises(ValueError, match="another optimizer"):
        hosts.per_host(plan, 2)


def test_profiles_round_trip_and_builtins_are_labelled(tmp_path):
    assert {"a100-80gb-pcie4", "h100-pcie5", "h200", "gh200", "cpu-2core"} <= set(BUILTIN)
    assert all(BUILTIN[n].source == "vendor" for n in ("a100-80gb-pcie4", "h100-pcie5", "h200", "gh200"))
    path = BUILTIN["gh200"].save(tmp_path / "gh200.json")
    assert load(str(path)) == BUILTIN["gh200"]
    with pytest.raises(HardwareError, match="h200"):
        load("no-such-profile")
    path.write_text(json.dumps({"name": "x"}))
    with pytest.raises(HardwareError, match="missing keys"):
        load(str(path))


@pytest.mark.slow  # runs the probe / a real vjp
def test_cli_plan_and_probe(tmp_path, capsys):
    assert cli.main(["plan", str(BIG[0]), "--hardware", "h100-pcie5", "--seq-len", "1024",
                     "--placement", "compute=ram,master=ram,opt=disk", "--compute-dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "device peak" in out and "bound by" in out and "tokens/s" in out and "opt=disk" in out
    # A placement that fits the profile: a run that does not fit exits non-zero (test_plan_cli.py).
    assert cli.main(["plan", str(BIG[1]), "--json", "--hardware", "h200",
                     "--placement", "compute=ram,master=disk,opt=disk"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["num_blocks"] == 96
    profile = tmp_path / "hw.json"
    assert cli.main(["probe", "--quick", "--dir", str(tmp_path), "--out", str(profile)]) == 0
    measured = load(str(profile))
    assert f"compute dtype {compute_dtype.choose(measured)[0]} (model.compute_dtype=auto" in capsys.readouterr().out
    assert measured.source == "measured" and measured.disk_read_bytes_per_s > 0 and measured.matmul_flops_fp32 > 0
    ckpt = tmp_path / "tiny"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({**json.loads(BIG[0].read_text()), "num_hidden_layers": 2,
                                                  "hidden_size": 64, "intermediate_size": 128, "vocab_size": 100,
                                                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}))
    assert cli.main(["plan", str(ckpt), "--hardware", str(profile)]) == 0
    assert "hardware     measured" in capsys.readouterr().out


def test_cli_bad_input_is_one_line_and_nonzero(tmp_path, capsys):
    assert cli.main(["plan", str(tmp_path / "missing.json")]) == 2
    assert cli.main(["plan", str(BIG[0]), "--hardware", "tpu-v9"]) == 2
    assert cli.main(["plan", str(BIG[0]), "--placement", "opt=tape"]) == 2
    assert cli.main(["plan", str(BIG[0]), "--hardware", "h200", "--batch-size", "4", "--processes", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "data.batch_size 4 must be a multiple of the number of processes (3)" in err[-1]
    assert len(err) == 4 and all(line.startswith("mtjax plan: error:") for line in err)


def test_cli_plans_a_multi_process_run_with_every_part_streamed(tmp_path, capsys):
    """A multi-process run streams every part (mtjax.stream.hosts.STREAMED), so its plan does:
    stream.resident auto parts none there, and a residency the run refuses is refused here."""
    (tmp_path / "config.json").write_text(json.dumps(hf.to_hf_dict(CFG)))
    plan = ["plan", str(tmp_path), "--hardware", "h200", "--batch-size", "2", "--json"]
    assert cli.main(plan) == 0
    assert json.loads(capsys.readouterr().out)["resident"]  # one process: the tiny model fits on the device
    assert cli.main([*plan, "--processes", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["resident"] == []
    assert cli.main([*plan, "--processes", "2", "--resident", "all"]) == 2
    assert "stream.resident='all' keeps whole parts on the device, but each of the 2 processes" in capsys.readouterr().err


@pytest.mark.parametrize("name, placement", [
    ("llama-70b-plan.yaml", "compute=ram,master=disk,opt=disk"),
    ("llama-175b-plan.yaml", "compute=ram,master=disk,opt=disk"),
    ("phi-4-plan.yaml", "compute=ram,master=ram,opt=disk"),
    ("gemma-2-27b-plan.yaml", "compute=ram,master=disk,opt=disk"),
    ("gemma-3-27b-plan.yaml", "compute=ram,master=disk,opt=disk"),
    ("llama-4-scout-plan.yaml", "compute=ram,master=disk,opt=disk"),
    ("mixtral-8x7b-plan.yaml", "compute=ram,master=ram,opt=ram"),
    ("qwen3-30b-a3b-plan.yaml", "compute=ram,master=ram,opt=ram"),
    ("qwen3-235b-a22b-plan.yaml", "compute=ram,master=ram,opt=disk"),
    ("deepseek-coder-v2-lite-plan.yaml", "compute=ram,master=ram,opt=ram"),
    ("gpt-oss-20b-plan.yaml", "compute=ram,master=ram,opt=ram"),
    ("qwen3.5-9b-plan.yaml", "compute=ram,master=ram,opt=ram"),
    # 128-512 experts a layer: seconds since identical parts are priced once (docs/planner.md).
    ("gpt-oss-120b-plan.yaml", "compute=ram,master=ram,opt=ram"),
    ("qwen3.5-35b-a3b-plan.yaml", "compute=ram,master=ram,opt=ram"),
    # 512 experts: 8-23 s (2 cores, load 3-5), most of it tracing the abstract block and its residuals once.
    pytest.param("qwen3-next-80b-a3b-plan.yaml", "compute=ram,master=ram,opt=ram", marks=pytest.mark.slow),
    ("qwen3.5-122b-a10b-plan.yaml", "compute=ram,master=ram,opt=ram"),
    pytest.param("qwen3.5-27b-plan.yaml", "compute=ram,master=ram,opt=ram", marks=pytest.mark.slow),
])
def test_shipped_plan_experiments_plan(name, placement, capsys):
    assert cli.main(["plan", str(ROOT / "experiments" / name), "--hardware", "h200"]) == 0
    out = capsys.readouterr().out
    assert f"placement {placement}" in out and "recommended" in out


# LoRA on one H200 host (issue 29's shipped plans): (file, predicted seconds a step as its
# header states them, what bounds it, bytes written a step). The configured placement fits.
# Adapters resident on the device (stream.adapters): nothing written per step but checkpoints.
LORA_PLANS = [("llama-3.1-405b-lora-bf16-plan.yaml", 445.8, "device compute", "0 B"),
              ("llama-3.1-405b-lora-nf4-plan.yaml", 445.8, "device compute", "0 B"),
              ("qwen3-235b-a22b-lora-bf16-plan.yaml", 66.2, "disk", "0 B"),
              ("qwen3-235b-a22b-lora-nf4-plan.yaml", 32.2, "device compute", "0 B")]


@pytest.mark.slow  # ~30 s each: 126 and 94 blocks priced under 8 placements
@pytest.mark.parametrize("name, step, bound, written", LORA_PLANS)
def test_shipped_lora_plans_fit_one_h200_host_as_their_headers_say(name, step, bound, written, capsys):
    assert cli.main(["plan", str(ROOT / "experiments" / name), "--hardware", "h200"]) == 0
    out = capsys.readouterr().out
    configured = next(line for line in out.splitlines() if "configured" in line)
    assert "DOES NOT FIT" not in configured
    assert float(next(line for line in out.splitlines() if line.startswith("step time")).split()[2]) == \
        pytest.approx(step, abs=0.1)
    assert f"bound by {bound}" in out and f"disk writes      {written} per step" in out


def test_preflight_from_an_experiment_config():
    from mtjax import config as experiment
    from mtjax.plan import inputs

    exp = experiment.load(None, ["store.opt=disk", "data.batch_size=4", "stream.keep_every=2"])
    run = inputs.from_experiment(exp)
    assert (run.shape.batch, run.stream.keep_every, run.store.opt) == (4, 2, "disk")
    plan = estimate(run.cfg, run.stream, run.store, run.shape, BUILTIN["cpu-2core"], tx=run.tx)
    assert plan.state.opt == schema_total(run.cfg, "opt") and plan.traffic.disk_read == plan.state.opt
    assert check(plan, available_ram=plan.ram_needed, free_disk=plan.disk_bytes) is None
    assert "short by 1 B" in check(plan, available_ram=plan.ram_needed, free_disk=plan.disk_bytes - 1)


def test_fused_and_partial_rotary_models_count_as_their_unfused_twins():
    """Phi-3's fused qkv_proj / gate_up_proj hold the same parameters as separate q, k, v,
    gate and up, and partial rotary adds no matmul: parameter counts (which the MFU line's
    FLOPs use), the HF layout and the plan's FLOPs agree with the Llama-shaped twin."""

    phi = dataclasses.replace(CFG, model_type="phi3", fused_projections=True, partial_rotary_factor=0.5)
    n = model.num_params(phi)
    assert n == model.num_params(CFG) == sum(math.prod(s.shape) for s in hf.layout(phi))
    assert {s.hf_name for s in hf.layout(phi)} >= {"model.layers.0.self_attn.qkv_proj.weight",
                                                    "model.layers.0.mlp.gate_up_proj.weight"}
    ours, twin = plan_of(phi), plan_of(CFG)
    assert (ours.num_params, ours.flops, ours.model_flops) == (twin.num_params, twin.flops, twin.model_flops)
    assert ours.num_params == n


def test_mfu_and_planner_count_attention_by_heads_times_head_dim():
    """Gemma's attention width (32 x 128 = 4096) is not its hidden size (4608): the MFU
    formula's attention term is the planner's (full score matrix, forward + backward = 3
    forwards), and both grow with head_dim, not hidden_size."""
    cfg = load_hf_config(ROOT / "experiments/hf_configs/gemma-2-27b.json")
    assert cfg.num_attention_heads * cfg.head_dim != cfg.hidden_size
    seq = 4096
    mfu_attention = 12.0 * seq * cfg.num_attention_heads * cfg.head_dim  # the usual MFU convention, per layer
    planner_attention = 3 * block_forward_flops(cfg, cfg.layer_specs[1], 0, 1, seq, executed=True) / seq
    assert mfu_attention == planner_attention
    wider = dataclasses.replace(cfg, head_dim=2 * cfg.head_dim)
    assert block_forward_flops(wider, wider.layer_specs[1], 0, 1, seq) == 2 * block_forward_flops(
        cfg, cfg.layer_specs[1], 0, 1, seq)


SHORT_LONG_ROWS = block_bytes.LongRows(threshold=256, step=128)  # the long-row path, brought down to short rows


def _priced_and_traced(cfg, kind, seq, policy="none"):
    """residual_bytes of `seq`-token rows priced from short traces (the long-row path,
    brought down to short rows) and traced whole."""
    return (block_bytes.residual_bytes(cfg, kind, 2, seq, policy, SHORT_LONG_ROWS),
            block_bytes._traced_residual_bytes(cfg, kind, 2, seq, policy))


@pytest.mark.parametrize("policy", ["none", "dots"])
def test_long_rows_price_residuals_as_a_whole_trace_does(policy):
    """The bytes a block keeps grow by the same amount with every token: the line through
    traces at 128, 256 and 384 tokens gives a 1000-token trace's bytes exactly."""
    priced, traced = _priced_and_traced(CFG, CFG.layer_specs[0], 1000, policy)
    assert priced == traced > 0


@pytest.mark.slow  # traces blocks of four families at 1000 tokens, ~20 s
@pytest.mark.parametrize("name", ["gemma-2-27b", "gemma-3-27b", "llama-4-scout"])
def test_long_rows_price_residuals_as_a_whole_trace_does_for_every_attention(name):
    """Sliding windows, soft-capping, chunked and NoPE layers and MoE blocks (whole and
    split into expert groups) keep per-token bytes too."""
    hf_dict = json.loads((ROOT / f"experiments/hf_configs/{name}.json").read_text())
    base = load_hf_config(ROOT / f"experiments/hf_configs/{name}.json")
    small = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, sliding_window=64 if base.sliding_window else None,
                 attention_chunk_size=64 if base.attention_chunk_size else None,
                 query_pre_attn_scalar=16.0 if base.query_pre_attn_scalar else None)
    if base.moe_layers:
        small.update(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32)
    cfg = from_hf_dict(hf_dict, **small)
    for kind in cfg.block_specs:
        priced, traced = _priced_and_traced(cfg, kind, 1000)
        assert priced == traced > 0, kind
    if cfg.moe_layers:
        kind = next(k for k in cfg.block_specs if k.feed_forward.kind == "moe")
        assert block_bytes.split_residual_bytes(cfg, kind, 2, 1000, 2, SHORT_LONG_ROWS) == \
            block_bytes._traced_split_residual_bytes(cfg, kind, 2, 1000, 2)


def test_a_long_row_is_never_traced_whole(monkeypatch):
    """Planning a 131072-token row (a context a model may have) traces blocks at short
    rows only, so the plan takes as long as a short row's does."""
    seqs, real = [], jax.eval_shape

    def recording(fn, *args, **kwargs):  # a trace's rows: its [batch, seq, hidden] arguments
        seqs.extend(a.shape[1] for a in args if isinstance(a, jax.ShapeDtypeStruct) and len(a.shape) == 3
                    and a.shape[-1] == CFG.hidden_size)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(jax, "eval_shape", recording)  # JAX's own function: the traces go through it
    cfg = dataclasses.replace(CFG, max_position_embeddings=131072)
    plan = plan_of(cfg, shape=StepShape(1, 131072))
    assert plan.device.residuals > 0 and seqs and max(seqs) <= block_bytes.LONG_ROWS.threshold


@pytest.mark.parametrize("group_size", [None, 2])
def test_residency_skips_sets_whose_resident_state_overflows_and_picks_as_pricing_every_set_does(group_size,
                                                                                                 monkeypatch):
    """`residency.choose` does not price the resident sets whose resident state alone
    exceeds the budget (one part of each class priced, not every set): on a MoE model,
    whole and split into expert groups, at budgets from nothing resident to all of it, it
    picks the plan that pricing every candidate set picks, figure for figure."""
    cfg = tiny_moe_config(compute_dtype="bfloat16")
    stream, store, shape = StreamConfig(keep_every=1, expert_group_size=group_size), StoreConfig(), StepShape(2, 16, 2)
    pb = step_bytes.part_bytes(cfg, TX)
    every = [estimate(cfg, dataclasses.replace(stream, resident=r, remat=m), store, shape, HW, part_bytes_=pb)
             for r in residency.candidates(cfg, stream) for m in ("full", "dots", "none")]
    totals = sorted({p.device.total for p in every})
    priced = []
    monkeypatch.setattr(residency, "estimate", lambda *a, **k: priced.append(a[1].resident) or estimate(*a, **k))
    for budget in [*totals[::max(1, len(totals) // 6)], totals[-1]]:
        fitting = [p for p in every if p.device.total <= budget]
        reference = min(fitting, key=lambda p: (p.times.step, p.traffic.h2d + p.traffic.d2h, p.device.total))
        priced.clear()
        assert residency.choose(cfg, stream, store, shape, HW, budget, TX) == reference
        if budget < totals[-1] // 2:  # the sets with every part resident, at least, were not priced
            assert len(priced) < len(every)


@pytest.mark.parametrize("lora_rank", [None, 2])
def test_abstract_parts_are_those_nnx_rngs_build(lora_rank):
    """A part's skeleton (model._skeleton) is built with one key for every draw, not
    nnx.Rngs (whose draw counter makes tracing a block of E experts quadratic in E): the
    same module structure and abstract weights, LoRA adapters included."""
    cfg = tiny_moe_config(lora=None if lora_rank is None else lora.LoraConfig(rank=lora_rank))
    for part in ("embed", "head", *cfg.block_specs):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: model._module_factory(cfg, part)(nnx.Rngs(0))))
        assert model._skeleton(cfg, part)[0] == graphdef
        assert model._abstract(cfg, part) == nnx.to_pure_dict(state)
