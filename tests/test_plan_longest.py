"""The planner's longest row (mtjax.plan.longest): the length it names fits the machine
and one step more does not; Llama-3.1-8B reaches 128k tokens on an H200 with every part
streamed; `mtjax plan --longest` prints it."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtjax import cli
from mtjax.config import StoreConfig, StreamConfig
from mtjax.model_config import load_hf_config
from mtjax.plan import BUILTIN, StepShape, estimate, fit
from mtjax.plan.hardware import GiB
from mtjax.plan.longest import STEP, search

from conftest import tiny_config

ROOT = Path(__file__).resolve().parent.parent


def _at(longest, seq, activations):
    p = longest.plan
    stream = dataclasses.replace(p.stream, activations=activations)
    return estimate(p.cfg, stream, p.store, dataclasses.replace(p.shape, seq=seq), p.hardware)


def test_the_longest_row_fits_and_one_step_longer_does_not():
    cfg = tiny_config(hidden_size=256, intermediate_size=512, vocab_size=32000, compute_dtype="bfloat16")
    hw = dataclasses.replace(BUILTIN["h200"], device_memory_bytes=2 * GiB)
    plan = estimate(cfg, StreamConfig(), StoreConfig(), StepShape(2, 1024), hw)
    room = fit.limits(hw)
    longest = search(plan, room)
    assert longest.seq > 0 and longest.seq % STEP == 0 and longest.plan.shape.seq == longest.seq
    assert longest.plan.shape.batch == 2 and longest.plan.schedule.resident == ()
    assert not fit.short_of(longest.plan, room)
    for activations in ("device", "host"):  # neither tier reaches one step further
        assert "device" in fit.short_of(_at(longest, longest.seq + STEP, activations), room)


@pytest.mark.slow
def test_llama_3_1_8b_trains_128k_tokens_on_an_h200_with_every_part_streamed():
    cfg = dataclasses.replace(load_hf_config(ROOT / "experiments/hf_configs/llama-3.1-8b.json"),
                              compute_dtype="bfloat16")
    hw = BUILTIN["h200"]
    longest = search(estimate(cfg, StreamConfig(), StoreConfig(), StepShape(1, 4096), hw), fit.limits(hw))
    assert longest.seq >= 128 * 1024 and longest.context == 131072


@pytest.mark.slow
def test_mtjax_plan_names_the_longest_row(capsys):
    cfg = ROOT / "experiments/hf_configs/llama-3-70b.json"
    assert cli.main(["plan", str(cfg), "--hardware", "h200", "--seq-len", "2048", "--longest", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["longest_seq"]
    assert shown["seq"] >= 2048 and shown["context"] == 8192 and shown["activations"] in ("device", "host")
    assert cli.main(["plan", str(cfg), "--hardware", "h200", "--seq-len", "2048", "--longest"]) == 0
    assert f"longest row  {shown['seq']:,} tokens a row with every part streamed" in capsys.readouterr().out


# The CPU profile's longest row, checked on this CPU at that limit: a cpu-2core profile
# with 3 GiB of RAM (its other figures as built in) puts a 2-block Llama's longest row at
# a few thousand tokens; that row, run for one step in a fresh process, peaks within the
# planner's RAM for it, and a row twice as long is refused.
_LONG_ROW_YAML = """\
model:
  preset: null
  model_type: llama
  vocab_size: 8192
  hidden_size: 128
  intermediate_size: 352
  num_hidden_layers: 2
  num_attention_heads: 2
  num_key_value_heads: 2
  head_dim: 64
  max_position_embeddings: 65536
  compute_dtype: float32
stream: {engine: stream, resident: none, keep_every: 1}
data: {dataset: unused.jsonl, seq_len: 1024, batch_size: 1}
"""

_ONE_STEP = """\
import dataclasses, sys
import numpy as np
from mtjax import model
from mtjax.optim import OptimConfig
from mtjax.plan import inputs
from mtjax.stream import StreamEngine
given, seq, activations, chunk = inputs.load(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
cfg = dataclasses.replace(given.cfg, ffn_chunk_tokens=chunk)
stream = dataclasses.replace(given.stream, activations=activations)
engine = StreamEngine(cfg, model.init_params(cfg, seed=0), OptimConfig(lr=1e-4), stream, given.store)
engine.step(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 1, seq), dtype=np.int32))
engine.close()
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print("peak_rss", peak * 1024)
"""


@pytest.mark.slow
def test_the_cpu_profiles_longest_row_runs_within_its_ram_and_a_longer_one_is_refused(tmp_path, capsys):
    exp = tmp_path / "long.yaml"
    exp.write_text(_LONG_ROW_YAML)
    hw = dataclasses.replace(BUILTIN["cpu-2core"], name="cpu-3gib", host_ram_bytes=3 * GiB)
    profile = hw.save(tmp_path / "cpu.json")
    assert cli.main(["plan", str(exp), "--hardware", str(profile), "--longest", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["longest_seq"]
    assert 4096 <= row["seq"] <= 16384 and row["ram_needed"] <= fit.limits(hw).ram

    # the planner refuses a row twice as long, in one line naming RAM
    assert cli.main(["plan", str(exp), "--hardware", str(profile), "--seq-len", str(2 * row["seq"])]) == 2
    refused = capsys.readouterr().err.strip()
    assert "does not fit cpu-3gib" in refused and "RAM" in refused and "\n" not in refused

    # the row itself, one step in a fresh process: its peak RSS within what the planner priced
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _ONE_STEP, str(exp), str(row["seq"]), row["activations"],
                           str(row["ffn_chunk_tokens"] or 0)], env=env, capture_output=True, text=True, check=True)
    peak = int(done.stdout.split("peak_rss")[-1])
    assert peak <= row["ram_needed"] <= fit.limits(hw).ram, (peak, row)
