"""Context parallel (stream.split: sequence): each row's tokens split over two CPU devices
train as one device does, to 1e-5; the attention over the split row equals the unsplit
kernel. One child process with two devices runs every case (tests/sequence_split_cases.py)."""

from __future__ import annotations

import pytest

import multidevice
from mtjax.config import DataConfig, ExperimentConfig, ModelSection, StreamConfig, model_config
from mtjax.model_config import ConfigError

SLOW = pytest.mark.slow  # one child: the JAX import and the compiles of two engines (~40 s here)


@pytest.fixture(scope="module")
def results():
    return multidevice.run(["tests/sequence_split_cases.py"], devices=2, timeout=600)


@SLOW
@pytest.mark.parametrize("name", ["plain", "window-softcap", "documents"])
def test_attention_over_a_split_row_equals_the_whole_rows(results, name):
    r = results["kernel"][name]
    assert max(r["errors"]) <= 1e-6, r["errors"]  # output, dq, dk, dv
    assert r["out_spec"] == "P(None, 'sequence')"  # each device keeps its share of the row


@SLOW
@pytest.mark.parametrize("name", ["plain", "documents"])
def test_two_devices_splitting_each_row_train_as_one_device(results, name):
    r = results[name]
    assert r["sequence_devices"] == [1, 2]  # the two-device programs' attention is split
    assert r["kept_specs"] == ["P(None, 'sequence')"]  # hidden states stay split between blocks
    assert r["loss_error"] <= 1e-5
    assert r["param_error"] <= 1e-5


@SLOW
def test_two_devices_hold_half_a_blocks_temporaries_each(results):
    """N devices train N times the context: a block's gradient at 8k tokens, split over two
    devices, needs about half the temporaries on each (the gathered keys and values aside)."""
    one, two = results["block_temp_bytes"]
    assert two <= 0.6 * one, (one, two)


@pytest.fixture(scope="module")
def planned():
    return multidevice.run(["tests/sequence_split_cases.py", "planned"], devices=16, timeout=600)


@SLOW  # one child of 16 devices: the JAX import, 10 compiles and the residual traces (~40 s here)
def test_a_split_attention_blocks_plan_holds_what_xla_allocates(planned):
    """Each device of a row split over N gathers the whole row's keys and values and sums
    their gradients over the whole row before the reduce-scatter: (N - 1) / N of the row
    beyond its share, priced by the attention entry's working bytes. Within 10% of XLA's
    temporaries from 4 devices on; without that term the plan misses by 28% at 8 and 74%
    at 16. At 2 devices the plan is above XLA's, by 13% (the traced residuals already
    price the loop kernel ~4% above XLA on one device)."""
    fp32 = planned["float32"]
    assert sorted(fp32, key=int) == ["2", "4", "8", "16"]
    for devices, r in fp32.items():
        temp, planned_, gathered = r["temp"], r["planned"], r["gathered"]
        if devices == "2":
            assert temp <= planned_ <= 1.15 * temp, r
        else:
            assert abs(temp / planned_ - 1) < 0.10, (devices, r)
        if devices in ("8", "16"):  # leaving the gathered keys and values out would miss
            assert temp > 1.10 * (planned_ - gathered), (devices, r)


@SLOW  # the same child
def test_a_split_bf16_attention_blocks_plan_holds_what_xla_allocates(planned):
    """Below fp32 XLA's CPU backend holds a split block's gathered keys and values in fp32
    and runs its weight-gradient matmuls in fp32 (their all-reduce promoted): priced, the
    bf16 block is within 10% of XLA's temporaries at 2 and 8 devices; the price before
    (gathered keys and values in bf16, no promoted matmuls) missed by 30%."""
    bf16 = planned["bfloat16"]
    assert sorted(bf16, key=int) == ["2", "8"]
    for devices, r in bf16.items():
        assert abs(r["temp"] / r["planned"] - 1) < 0.10, (devices, r)
        assert r["temp"] > 1.10 * (r["planned"] - r["promoted"]), (devices, r)  # the promoted matmuls are real


@SLOW  # the same child
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_split_rows_keep_their_tokens_split(planned, dtype):
    """Two rows a micro-batch, each split over the devices: every token-wise layer keeps
    each device's share of both rows (mtjax.layers.basic.rows), so the block holds its
    price per device. Flattened row-major, the dense layers ran over all rows on every
    device: fp32 1.69x its price at 2 devices, 4.75x at 8 (4096 tokens)."""
    cases = planned[f"{dtype} batch 2"]
    assert sorted(cases, key=int) == ["2", "8"]
    for devices, r in cases.items():
        assert abs(r["temp"] / r["planned"] - 1) < 0.10, (devices, r)


@SLOW  # the same child
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_split_rows_keep_their_tokens_split_through_the_head(planned, dtype):
    """The head's loss over two rows split over N devices holds about 1/N of its
    temporaries on one device, and hands back the hidden states' gradient split
    (mtjax.loss.head_loss orders the tokens as basic.rows does). Flattened row-major,
    every device ran the head over both whole rows: fp32 1.40x the one device's
    temporaries at 2 devices and at 8, its gradient whole on each."""
    cases = planned["head batch 2"][dtype]
    whole = cases["1"]["temp"]
    for devices in ("2", "8"):
        r = cases[devices]
        assert r["temp"] <= 1.3 * whole / int(devices), (devices, whole, r)
        assert r["dx_spec"] == "P(None, 'sequence')", (devices, r)


@SLOW  # the same child
def test_a_split_heads_chunks_take_every_devices_share(planned):
    """In several chunks (1024 tokens; a large vocabulary's head has hundreds), each chunk
    takes every n-th token, so every device computes its own share of each chunk: the
    same loss and hidden gradient as one device's, and at N devices at most 2/N of its
    temporaries. Chunks of consecutive tokens lay on one device each: the scan over them
    gathered the row onto every device, 1.54x one device's temporaries at 2, 1.11x at 8.
    (At 2 devices still 0.88x: the token-major and strided copies of the share.) The plan
    prices those copies (mtjax.loss.head_bytes): without them XLA held 1.52x its price at 2."""
    cases = planned["head batch 2"]["chunked"]
    assert max(cases["errors"]) <= 1e-5, cases["errors"]
    whole = cases["1"]["temp"]
    for devices in ("2", "8"):
        r = cases[devices]
        assert r["temp"] <= 2 * whole / int(devices), (devices, whole, r)
        assert 0.85 <= r["temp"] / r["planned"] <= 1.10, (devices, r)


@SLOW  # the same child
def test_a_split_bf16_heads_reorderings_are_priced_only_while_its_chunks_run(planned):
    """Below fp32 the head's peak on the CPU is the final norm's backward in fp32, after
    the chunks: the token-major and every-n-th-token copies of the share are dead by then.
    Priced beside it (as the fp32 head's sum), XLA held 0.73x the price at 2 devices and
    0.75x at 8 (bf16, 2 x 8192 tokens in chunks of 1024); 0.90x and 0.92x now."""
    cases = planned["head batch 2"]["bf16 chunked"]
    for devices in ("2", "8"):
        r = cases[devices]
        assert 0.85 <= r["temp"] / r["planned"] <= 1.10, (devices, r)


@SLOW  # the same child
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_split_delta_net_block_is_priced_with_its_whole_row_scan(planned, dtype):
    """The delta rule's scan over chunks is sequential in t: on a row split over N
    devices every device gathers the whole row's scan inputs and runs every chunk
    (mtjax.layers.delta_net); the rest of the block keeps its share. Priced with those
    inputs and their cotangents (the mixer's working bytes), two rows of 4096 tokens are
    within 10% of XLA's temporaries at 2 and 8 devices; priced as one device's share,
    XLA held 1.8x the price at 8."""
    cases = planned["mixers"]["delta-net"][dtype]
    for devices, r in cases.items():
        assert abs(r["temp"] / r["planned"] - 1) < 0.10, (devices, r)
    assert cases["8"]["temp"] > 1.10 * (cases["8"]["planned"] - cases["8"]["gathered"]), cases["8"]


@SLOW  # the same child
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_split_latent_attention_block_keeps_two_rows_tokens_split(planned, dtype):
    """DeepSeek's latent attention over two rows split over N devices: its projections and
    norms keep each device's share (basic.rows), so the block is within 10% of its price
    per device at 2 and 8, as the softmax block is."""
    for devices, r in planned["mixers"]["latent"][dtype].items():
        assert abs(r["temp"] / r["planned"] - 1) < 0.10, (devices, r)


@SLOW  # the same child
@pytest.mark.parametrize("name", ["delta-net", "latent"])
def test_two_split_rows_through_delta_net_and_latent_attention_equal_one_device(planned, name):
    r = planned["mixers"][name]
    assert max(r["errors"]) <= 1e-5, r["errors"]  # output, hidden gradient, weight gradients
    assert r["out_spec"] == "P(None, 'sequence')", r


def test_a_row_that_does_not_split_is_one_line():
    with pytest.raises(ConfigError, match=r"data.seq_len 10 does not split over 4 devices \(stream.split: sequence\)"):
        ExperimentConfig(stream=StreamConfig(devices=4, split="sequence"), data=DataConfig(batch_size=1, seq_len=10))
    ExperimentConfig(stream=StreamConfig(devices=4, split="sequence"), data=DataConfig(batch_size=1, seq_len=12))
    with pytest.raises(ConfigError, match="stream.split"):
        StreamConfig(split="tokens")
    with pytest.raises(ConfigError, match="model.sequence_devices is set by the engine"):
        model_config(ExperimentConfig(model=ModelSection(overrides=(("sequence_devices", 2),))))
