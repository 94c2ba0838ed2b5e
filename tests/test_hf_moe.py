"""mtjax's mixtures of experts equal transformers' on the same weights, and their
checkpoints go in and out unchanged.

Per MoE family a tiny random transformers model (1-D parameters perturbed, 16 experts of
which 2 are picked, so some are unrouted in the batch) is saved with `save_pretrained`
(which writes one tensor per expert, but for Llama 4's and gpt-oss's stacked experts), loaded with `mtjax.load_params` and compared in
fp32: logits, the training loss with the load-balancing term (transformers'
`output_router_logits=True`), and the gradient of every tensor, routers included.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import mtjax
import mtjax.store
import parity
from mtjax import hf
from mtjax.reference import loss_terms

pytestmark = pytest.mark.slow  # transformers + torch models side by side

BATCH, SEQ = 2, 6
MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.05)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    family: str
    overrides: dict
    moe_layers: tuple[int, ...]
    k: int = 2  # experts per token
    shared: int = 0  # the shared expert's width
    aux: bool = True  # the training loss has a load-balancing term


CASES = [
    Case("mixtral", "mixtral", dict(num_local_experts=16, intermediate_size=24, **MOE), (0, 1)),
    Case("qwen2-moe-shared", "qwen2_moe", dict(num_experts=16, moe_intermediate_size=24,
                                               shared_expert_intermediate_size=40, **MOE), (0, 1), shared=40),
    Case("qwen3-moe-norm-dense-1", "qwen3_moe", dict(num_experts=16, moe_intermediate_size=24, norm_topk_prob=True,
                                                     num_hidden_layers=3, mlp_only_layers=[1], **MOE), (0, 2)),
    Case("qwen3-moe-step2", "qwen3_moe", dict(num_experts=16, moe_intermediate_size=24, norm_topk_prob=False,
                                              num_hidden_layers=3, decoder_sparse_step=2, **MOE), (1,)),
    # pad_token_id None: transformers freezes the padding row of the embedding, mtjax does not.
    Case("olmoe", "olmoe", dict(num_experts=16, pad_token_id=None, **MOE), (0, 1)),
    # Llama 4: chunks of 5 in rows of 6 on RoPE layer 0, NoPE layers 1 and 2, dense layer 1
    # (moe_layers wins over interleave_moe_layer_step), top 1 of 16, a shared expert, no
    # load-balancing term.
    Case("llama4-text", "llama4_text", dict(num_local_experts=16, num_experts_per_tok=1, num_hidden_layers=3,
                                            moe_layers=[0, 2], interleave_moe_layer_step=2, no_rope_layers=[1, 0, 0],
                                            attention_chunk_size=5, router_aux_loss_coef=0.05),
         (0, 2), k=1, shared=56, aux=False),
    # DeepSeek: latent attention, the first layer dense, 16 experts in 4 groups of which each
    # token's 2 come from its best 2, a shared expert, no load-balancing term. V3: sigmoid
    # scores with the (perturbed) correction bias, a q bottleneck, yarn with mscale folded
    # into the softmax scale, or RoPE over halves, two shared experts, weights not
    # renormalised; V2: softmax, plain q_proj, scaled weights.
    Case("deepseek-v3-yarn", "deepseek_v3", dict(num_hidden_layers=3, num_key_value_heads=4, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32, mscale=0.9, mscale_all_dim=0.7,
        rope_theta=10000.0)), (1, 2), shared=24, aux=False),
    Case("deepseek-v3-rotate-half", "deepseek_v3", dict(num_key_value_heads=4, rope_interleave=False,
                                                        n_shared_experts=2, norm_topk_prob=False,
                                                        routed_scaling_factor=1.7),
         (1,), shared=48, aux=False),
    Case("deepseek-v2-grouped", "deepseek_v2", dict(num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None,
                                                    topk_method="group_limited_greedy", routed_scaling_factor=1.5),
         (1, 2), shared=24, aux=False),
    # gpt-oss: sinks, q/k/v/o biases, a window of 3 in rows of 6 on layer 0 (full on 1),
    # yarn; a router with a bias, top 2 of 16 then their softmax, experts with biases and
    # the clamped SwiGLU at a limit that clamps here (and an odd alpha).
    Case("gpt-oss", "gpt_oss", dict(swiglu_limit=0.1, swiglu_alpha=1.3, **MOE), (0, 1)),
]


_RUNS: dict[str, parity.HfRun] = {}


@pytest.fixture(params=CASES, ids=[c.id for c in CASES])
def case(request, tmp_path_factory) -> tuple[Case, parity.HfRun]:
    c: Case = request.param
    if c.id not in _RUNS:
        _RUNS[c.id] = parity.hf_run(tmp_path_factory.mktemp(c.id), c.family, c.overrides, (BATCH, SEQ),
                                    router_logits=True)
    return c, _RUNS[c.id]


def test_checkpoint_is_the_case_asked_for(case):
    """Guards the other tests: the layers asked to be MoE are, and some experts get no token."""
    c, r = case
    assert r.cfg.moe_layers == c.moe_layers and r.cfg.num_experts == 16
    assert r.cfg.num_experts_per_tok == c.k and r.cfg.shared_expert_intermediate_size == c.shared
    reader = hf.SafetensorsReader(r.ckpt)
    if c.family == "llama4_text":  # all experts in one [E, d, 2f] and one [E, f, d] tensor per layer
        assert reader.shape("model.layers.0.feed_forward.experts.gate_up_proj") == (16, 32, 2 * 56)
        assert r.cfg.no_rope_layers == (1, 2) and r.cfg.attention_chunk_size == 5 < SEQ
    elif c.family == "gpt_oss":  # stacked, gate and up interleaved, with biases; sinks; a window shorter than a row
        assert reader.shape("model.layers.0.mlp.experts.gate_up_proj") == (16, 32, 2 * 56)
        assert reader.shape("model.layers.0.mlp.experts.gate_up_proj_bias") == (16, 2 * 56)
        assert reader.shape("model.layers.1.self_attn.sinks") == (4,)
        assert r.cfg.layer_types == ("sliding_attention", "full_attention") and r.cfg.sliding_window == 3 < SEQ
        assert r.cfg.rope_scaling.rope_type == "yarn"
    else:
        assert any(".experts.15." in n for n in reader.names())  # one tensor per expert on disk
    assert len(r.router_logits) == len(c.moe_layers)
    unrouted = [16 - len(set(np.argsort(-lg, axis=-1)[:, :c.k].ravel())) for lg in r.router_logits]
    assert all(n > 0 for n in unrouted), unrouted


def test_logits_match(case):
    _, r = case
    logits = np.asarray(mtjax.forward(r.cfg, r.params, jnp.asarray(r.tokens)))
    scale = np.abs(r.hf_logits).max()
    assert np.abs(logits - r.hf_logits).max() <= 1e-5 * scale


def test_loss_with_the_load_balancing_term_matches(case):
    """transformers' loss with output_router_logits=True: with the load-balancing term, but
    Llama4ForCausalLM's, which adds none (nor does mtjax, whatever router_aux_loss_coef says)."""
    c, r = case
    loss, aux = loss_terms(r.cfg, r.params, jnp.asarray(r.tokens), remat=False)
    assert abs(float(loss) - r.hf_loss) <= 1e-6 * abs(r.hf_loss), (float(loss), r.hf_loss)
    if c.aux:
        assert r.cfg.router_aux_loss_coef * float(aux) > 1e-3 * r.hf_loss  # the term is not negligible here
    else:
        assert r.cfg.router_aux_loss_coef == 0 and float(aux) > 0


def test_every_gradient_matches(case):
    _, r = case
    checked = parity.assert_gradients_match(r.cfg, r.params, r.tokens, r.hf_grads)
    assert any(".gate." in name or ".router." in name for name in checked)  # the routers are among them


def test_export_is_bit_exact_and_reloads_in_transformers(case, tmp_path):
    """From params and through a layer store (one array per expert): the same files."""
    _, r = case
    parity.assert_export_bit_exact(r, tmp_path, r.tokens)
    with mtjax.store.open(tmp_path / "store") as store:  # one array per expert, fused on disk or not
        leaves = store.read(f"block.{r.cfg.moe_layers[0]}", "master").result()
        assert {f"mlp.experts.{e}.{p}.kernel" for e in range(16) for p in ("gate_proj", "up_proj", "down_proj")} \
            <= set(leaves)
