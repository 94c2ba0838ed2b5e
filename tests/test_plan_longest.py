"""The planner's longest row (mtjax.plan.longest): the length it names fits the machine
and one step more does not; Llama-3.1-8B reaches 128k tokens on an H200 with every part
streamed; `mtjax plan --longest` prints it."""

import dataclasses
import json
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
