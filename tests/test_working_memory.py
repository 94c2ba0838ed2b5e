"""The device plan's bytes for one block's recompute and backward against XLA's buffer assignment.

For a gated delta-net block and a gated softmax attention block of one Qwen3.5 model
(mtjax.families.qwen3_5: width 128, 4 query heads of 32 over 2, 2 key and 4 value heads
of 32 in the delta-net, fp32, one row; the delta-net in bf16 too), and a Qwen3-MoE block of the same attention
width (16 experts of 64, top 2, fp32 and bf16; 32 with LoRA on them; whole, or one group
of its experts), the planner prices a block's backward as its vjp residuals
(traced from the block, mtjax.stream.block_bytes.residual_bytes) plus what its mixer's
kernels and its feed-forward hold beyond them (the layer registry's `working`,
block_bytes.block_working_bytes). XLA's temporaries for the compiled program the engine
runs (mtjax.stream.blockfns._grad; memory_analysis: nothing runs) must lie within 10% of
that at rows of 256, 1024 (attention's unrolled chunks, O(t^2)) and 4096 tokens (its
loop, O(t)); the MoE blocks at 256 and 1024; a DeepSeek-width latent attention block
(fp32 and bf16, 512 tokens) and a softmax one of 4 heads of 64 (1024) on the unrolled chunks.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from mtjax import attention_bytes, attention_chunked, expert_groups, loss, parts
from mtjax.layers import delta_rule, registry
from mtjax.config import StoreConfig, StreamConfig
from mtjax.lora import LoraConfig
from mtjax.model_config import ModelConfig
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.stream import block_bytes, blockfns, groupfns, schedule, step_bytes

from conftest import tiny_config, tiny_moe_config

CFG = ModelConfig(model_type="qwen3_5_text", vocab_size=256, hidden_size=128, intermediate_size=384,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  rms_norm_offset=True, qk_norm=True, partial_rotary_factor=0.25, delta_net_layers=(0,),
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                  linear_value_head_dim=32, max_position_embeddings=4096)
TOLERANCE = 0.10


def compiled_temp_bytes(index: int, seq: int, cfg: ModelConfig = CFG) -> int:
    spec = cfg.layer_specs[index]
    w = parts.schema(cfg, f"block.{index}", "compute")
    x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), np.dtype(cfg.compute_dtype))
    grad = jax.jit(lambda w, x, dy: blockfns._grad(cfg, spec, w, x, dy, {}))
    return grad.lower(w, x, x).compile().memory_analysis().temp_size_in_bytes


def priced_bytes(index: int, seq: int, cfg: ModelConfig = CFG) -> tuple[int, int]:
    """(the block's traced vjp residuals, its mixer's working bytes) on this CPU."""
    spec = cfg.layer_specs[index]
    return block_bytes.residual_bytes(cfg, spec, 1, seq), registry.mixer(spec).working(cfg, spec, 1, seq, "cpu", 1)


def rule_residual_bytes(seq: int) -> int:
    """What the chunked delta rule alone keeps for its backward, traced as the planner traces a block."""
    hv, dk, dv = CFG.linear_num_value_heads, CFG.linear_key_head_dim, CFG.linear_value_head_dim
    qk, v = (jax.ShapeDtypeStruct((1, seq, hv, d), np.float32) for d in (dk, dv))
    gates = jax.ShapeDtypeStruct((1, seq, hv), np.float32)
    saved = jax.eval_shape(lambda *a: jax.vjp(lambda *b: delta_rule.chunked(*b)[0], *a)[1], qk, qk, v, gates, gates)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(saved))


@pytest.mark.parametrize("seq", [256, 1024, 4096])
def test_one_blocks_backward_is_priced_as_xla_allocates_it(seq):
    assert [s.mixer.kind for s in CFG.layer_specs] == ["gated_delta_net", "softmax_attention"]
    for index in (0, 1):
        temp = compiled_temp_bytes(index, seq)
        residuals, working = priced_bytes(index, seq)
        assert abs(temp / (residuals + working) - 1) < TOLERANCE, (index, seq, temp, residuals, working)
        if index == 0:
            # The rule's own per-chunk fp32 states and [c, c] matrices are more than the
            # tolerance: a price that left them out would miss.
            assert rule_residual_bytes(seq) > 2 * TOLERANCE * temp, (seq, rule_residual_bytes(seq), temp)
        elif seq <= attention_chunked.UNROLLED_CHUNKS * attention_chunked.CHUNK_ROWS:
            # unrolled chunks (2 at 256, 8 at 1024): the residuals alone miss by more than the tolerance
            assert temp > (1 + 2 * TOLERANCE) * residuals, (seq, temp, residuals)
        else:  # the loop: one [128, 128] block's probabilities and their gradient
            assert working < 0.05 * temp


@pytest.mark.parametrize("seq", [256, 1024, 4096])
def test_a_bf16_delta_net_blocks_backward_is_its_residuals(seq):
    """In bf16 too the delta-net block holds its traced residuals and nothing beyond them
    on one device (the rule's states and [c, c] matrices are fp32 whatever the inputs'
    dtype, and traced so): XLA's temporaries are 0.97-0.99x that price here."""
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16")
    temp = compiled_temp_bytes(0, seq, cfg)
    residuals, working = priced_bytes(0, seq, cfg)
    assert working == 0
    assert abs(temp / residuals - 1) < TOLERANCE, (seq, temp, residuals)


def test_a_bf16_attention_loop_is_priced_with_its_fp32_queries_keys_and_values():
    """Below fp32 the CPU's loop kernel carries fp32 copies of the queries, keys and values
    from the recompute to the backward: at 4 key/value heads of 64 (as wide as the
    queries) a price without them missed XLA's temporaries by 20% at 4096 tokens."""
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16", head_dim=64, num_key_value_heads=4)
    temp = compiled_temp_bytes(1, 4096, cfg)
    residuals, working = priced_bytes(1, 4096, cfg)
    assert abs(temp / (residuals + working) - 1) < TOLERANCE, (temp, residuals, working)


# Attention's unrolled chunks where each chunk's slices of the keys and values are a large
# share: a DeepSeek-width latent attention block (8 heads of 128 + 64 rotary dims, values of
# 128, kv_lora 512, q_lora 192: the kernel gets all three padded to 192) over 512 tokens in
# fp32 and bf16, and a softmax block of 4 query and 4 key/value heads of 64 over 1024. XLA
# shares the recompute's per-chunk slices with the backward's and holds them together; a
# price without them missed by 18% and 22% (latent, fp32 and bf16) and 11% (softmax).
UNROLLED = {"latent fp32": (ModelConfig(model_type="deepseek_v3", vocab_size=256, hidden_size=256,
                                        intermediate_size=512, num_hidden_layers=1, num_attention_heads=8,
                                        num_key_value_heads=8, head_dim=64, q_lora_rank=192, kv_lora_rank=512,
                                        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=4096), 0, 512),
            "softmax head dim 64": (dataclasses.replace(CFG, head_dim=64, num_key_value_heads=4), 1, 1024)}
UNROLLED["latent bf16"] = (dataclasses.replace(UNROLLED["latent fp32"][0], compute_dtype="bfloat16"), 0, 512)


@pytest.mark.parametrize("which", list(UNROLLED))
def test_attentions_unrolled_chunks_are_priced_with_their_key_and_value_slices(which):
    cfg, index, seq = UNROLLED[which]
    temp = compiled_temp_bytes(index, seq, cfg)
    residuals, working = priced_bytes(index, seq, cfg)
    assert abs(temp / (residuals + working) - 1) < TOLERANCE, (which, temp, residuals, working)


def test_a_plan_prices_the_mixer_for_the_device_planned_for():
    """A plan for a GPU (`mtjax plan --hardware h200`, made on any machine) prices the
    attention as the GPU runs it (fused kernels), a plan for the CPU as the CPU's loop:
    with its fp32 queries, keys and values below fp32. Traced on this CPU, the GPU plan
    carried the CPU's term."""
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16", head_dim=64, num_key_value_heads=4)
    tx = make_optimizer(OptimConfig())
    device = {host: schedule.describe(cfg, StreamConfig(), StoreConfig(), step_bytes.StepShape(1, 4096), tx,
                                      reads_host=host).device for host in (True, False)}
    cpu, gpu = (block_bytes.block_working_bytes(cfg, 1, 4096, platform=p) for p in ("cpu", "gpu"))
    assert cpu > gpu
    assert device[True].working - device[False].working == cpu - gpu


def test_a_plan_prices_the_head_for_the_device_planned_for():
    """The head too (one rule for every term): an H200 plan made on this CPU prices the
    GPU's chunked head, not the CPU's (which adds the chunk's logit gradient or kernel
    gradient and the final norm's fp32 output and gradient per token)."""
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16", vocab_size=8192)
    tx = make_optimizer(OptimConfig())
    head = {host: schedule.describe(cfg, StreamConfig(), StoreConfig(), step_bytes.StepShape(1, 4096), tx,
                                    reads_host=host).device.head for host in (True, False)}
    assert loss.head_bytes(cfg, 4096, "cpu") > loss.head_bytes(cfg, 4096, "gpu")
    assert head == {True: loss.head_bytes(cfg, 4096, "cpu"), False: loss.head_bytes(cfg, 4096, "gpu")}


def test_fused_gpu_kernels_and_a_split_row_hold_one_block_of_scores_or_none():
    spec = CFG.layer_specs[1]
    working = registry.mixer(spec).working
    bf16 = dataclasses.replace(CFG, compute_dtype="bfloat16")
    assert working(bf16, spec, 1, 1024, "gpu", 1) == 0  # cuDNN's flash attention keeps its tiles on chip
    # a row split over 2 devices takes the loop: one block's probabilities and their gradient,
    # and the other device's share of keys and values gathered (fp32) and their fp32 cotangents
    other = 512 * CFG.num_key_value_heads * CFG.head_dim
    assert working(CFG, spec, 1, 512, "cpu", 2) == 2 * 4 * CFG.num_attention_heads * 128 * 128 + 4 * 4 * other
    assert working(CFG, spec, 1, 512, "cpu", 1) > 4 * working(CFG, spec, 1, 512, "cpu", 2)
    # a dense feed-forward adds nothing: the block's working bytes are its mixer's
    assert block_bytes.block_working_bytes(CFG, 1, 1024, platform="cpu") == working(CFG, spec, 1, 1024, "cpu", 1)


def test_a_split_row_below_fp32_is_priced_in_fp32_on_the_cpu_only():
    """XLA's CPU backend gathers a split row's keys and values in fp32 and runs a bf16
    block's weight-gradient matmuls in fp32 (block_bytes.promoted_bytes; checked against the
    compiled split block in tests/test_sequence_split.py); a GPU's price is as it was."""
    spec, bf16 = CFG.layer_specs[1], dataclasses.replace(CFG, compute_dtype="bfloat16")
    other = 512 * CFG.num_key_value_heads * CFG.head_dim
    gathered = lambda platform: attention_bytes.gathered_bytes(  # noqa: E731
        platform, "bfloat16", 1, CFG.num_key_value_heads, 512, CFG.head_dim, 2)
    assert (gathered("cpu"), gathered("gpu")) == (2 * other * (4 + 4), 2 * other * (2 + 4))
    working, promoted = registry.mixer(spec).working, block_bytes.promoted_bytes(bf16, spec, 1, 512)
    assert promoted > 0
    block = lambda cfg, platform, devices=1: block_bytes.block_working_bytes(cfg, 1, 512, platform=platform,  # noqa: E731
                                                                          devices=devices)
    assert block(bf16, "cpu", 2) >= working(bf16, spec, 1, 512, "cpu", 2) + promoted
    # one device, fp32 or a GPU: nothing promoted, the larger mixer's (split, the delta-net's gathered scan)
    mixers = lambda cfg, platform, devices: max(  # noqa: E731
        registry.mixer(s).working(cfg, s, 1, 512, platform, devices) for s in CFG.layer_specs)
    assert block(bf16, "cpu") == mixers(bf16, "cpu", 1)
    assert block(CFG, "cpu", 2) == mixers(CFG, "cpu", 2)
    assert block(bf16, "gpu", 2) == mixers(bf16, "gpu", 2)


# Qwen3-MoE blocks (block 0 of tiny_moe_config's three) of the Qwen3.5 model's attention
# width on this CPU (the blocked dispatch): 16 experts, fp32 and bf16 (XLA's CPU backend
# computes the bf16 dispatch's matmuls and scatter in fp32, the copies a third of the
# block's temporaries: the price before it counted them missed by 16-26%), and fp32 with
# LoRA on 32 experts, where the adapted kernels' cotangents are a larger share.
MOE_WIDTH = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
                 moe_intermediate_size=64, max_position_embeddings=4096)
MOE = {"plain": tiny_moe_config(**MOE_WIDTH, num_experts=16),
       "bf16": tiny_moe_config(**MOE_WIDTH, num_experts=16, compute_dtype="bfloat16"),
       "experts adapted": tiny_moe_config(**MOE_WIDTH, num_experts=32,
                                          lora=LoraConfig(rank=4, target_modules=("experts",)))}


def moe_block_temp_bytes(cfg: ModelConfig, seq: int) -> int:
    """XLA's temporaries for block 0's recompute and backward, against its trained leaves as the engine runs it."""
    spec = cfg.layer_specs[0]
    w = parts.schema(cfg, "block.0", "compute")
    trained = parts.trained(cfg, "block.0") if cfg.lora is not None else None
    x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), np.dtype(cfg.compute_dtype))
    stats = {n: jax.ShapeDtypeStruct((cfg.num_experts,), np.float32) for n in ("probs", "counts")}
    grad = jax.jit(lambda w, x, dy, ds: blockfns._grad(cfg, spec, w, x, dy, ds, trained=trained))
    return grad.lower(w, x, x, stats).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("seq", [256, 1024])
@pytest.mark.parametrize("which", list(MOE))
def test_a_moe_blocks_backward_is_priced_as_xla_allocates_it(which, seq):
    cfg = MOE[which]
    temp = moe_block_temp_bytes(cfg, seq)
    residuals = block_bytes.residual_bytes(cfg, cfg.layer_specs[0], 1, seq)
    working = block_bytes.block_working_bytes(cfg, 1, seq, "blocked", platform="cpu")
    assert abs(temp / (residuals + working) - 1) < TOLERANCE, (which, seq, temp, residuals, working)
    spec = cfg.layer_specs[0]
    experts = registry.feed_forward(spec).working(cfg, spec, seq, "blocked")
    # leaving the experts' term out would miss by more than the tolerance
    assert temp > (1 + TOLERANCE) * (residuals + working - experts), (temp, residuals, working, experts)
    if cfg.lora is not None and seq == 256:  # and so would leaving the adapted kernels' share of it out
        plain = registry.feed_forward(spec).working(dataclasses.replace(cfg, lora=None), spec, seq, "blocked")
        assert temp > (1 + TOLERANCE) * (residuals + working - experts + plain), (temp, experts, plain)


def test_an_expert_groups_backward_is_priced_as_xla_allocates_it():
    """The program of one group of 8 of the 16 experts (mtjax.stream.groupfns) over 256
    rows, whose residuals are the larger of the split block's two programs' here."""
    cfg, seq, size = MOE["plain"], 256, 8
    spec = cfg.layer_specs[0]
    w = expert_groups.kernels(parts.schema(cfg, "block.0", "compute"), tuple(range(size)))
    h = jax.ShapeDtypeStruct((seq, cfg.hidden_size), np.float32)
    weights = jax.ShapeDtypeStruct((seq, cfg.num_experts_per_tok), np.float32)
    chosen = jax.ShapeDtypeStruct((seq, cfg.num_experts_per_tok), np.int32)
    ids = jax.ShapeDtypeStruct((size,), np.int32)
    grad = jax.jit(lambda w, h, p, c, i, dz: groupfns._group_grad(cfg, spec, w, h, p, c, i, dz))
    temp = grad.lower(w, h, weights, chosen, ids, h).compile().memory_analysis().temp_size_in_bytes
    residuals = block_bytes.split_residual_bytes(cfg, spec, 1, seq, size)
    working = registry.feed_forward(spec).working(cfg, spec, seq, "blocked", size)
    assert abs(temp / (residuals + working) - 1) < TOLERANCE, (temp, residuals, working)
    assert temp > (1 + TOLERANCE) * residuals  # the group's experts' term is real
    assert working < registry.feed_forward(spec).working(cfg, spec, seq, "blocked")  # and a group's, not the block's


# The LM head + loss program (blockfns._head: mtjax.loss's chunked head, 256-token chunks)
# against the plan's head term (mtjax.loss.head_bytes) on this CPU, untied: fp32 at a wide
# vocabulary (two chunks of fp32 logits live, where the old price said three) and bf16 at a
# wide width (the fp32 sum of the kernel's gradient and a chunk's share of it, [width, vocab]
# each, where the old price counted neither); and bf16 tied, whose transposed kernel copy
# lives in the embedding gradient's output buffer (a price that counted it as a temporary
# was high: XLA held 0.83-0.95 of it); and bf16 at a small vocabulary with Qwen3.5's norm
# (rms_norm_offset), where the per-token arrays outweigh a chunk's: an fp32 copy of the
# input, the scan's input widened to fp32 and the norm's backward in three fp32 arrays
# (priced as the fp32 head's, XLA held 1.67x the price at 2048 tokens).
HEAD = {"fp32": tiny_config(vocab_size=8192, hidden_size=128, head_chunk_tokens=256),
        "bf16": tiny_config(vocab_size=2048, hidden_size=512, head_chunk_tokens=256, compute_dtype="bfloat16"),
        "bf16 tied": tiny_config(vocab_size=2048, hidden_size=512, head_chunk_tokens=256, compute_dtype="bfloat16",
                                 tie_word_embeddings=True),
        "bf16 offset": tiny_config(vocab_size=256, hidden_size=128, head_chunk_tokens=256, compute_dtype="bfloat16",
                                   rms_norm_offset=True)}


@pytest.mark.parametrize("seq", [512, 2048])
@pytest.mark.parametrize("which", list(HEAD))
def test_the_head_program_is_priced_as_xla_allocates_it(which, seq):
    cfg = HEAD[which]
    w = parts.schema(cfg, "head", "compute")
    embed = parts.schema(cfg, "embed", "compute") if cfg.tie_word_embeddings else None
    x = jax.ShapeDtypeStruct((1, seq, cfg.hidden_size), np.dtype(cfg.compute_dtype))
    tokens = jax.ShapeDtypeStruct((1, seq), np.int32)
    program = jax.jit(lambda w, e, x, t: blockfns._head(cfg, w, e, x, t, 1.0))
    temp = program.lower(w, embed, x, tokens).compile().memory_analysis().temp_size_in_bytes
    priced = loss.head_bytes(cfg, seq, "cpu")
    assert abs(temp / priced - 1) < TOLERANCE, (which, seq, temp, priced)
