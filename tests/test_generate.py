"""Generation: the compiled sampling loop against a step-by-step reference loop."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from mtjax import cli, generate, hf, model
from mtjax.commands import generate as generate_command
from mtjax.data import ByteTokenizer, load_tokenizer
from mtjax.model_config import CHUNKED, FULL, SLIDING, ModelConfig, RopeScaling

from conftest import tiny_config

# Large initial weights make greedy decoding of a random model varied rather than constant.
CFG = tiny_config(vocab_size=61, max_position_embeddings=24, initializer_range=0.5)
_forward = jax.jit(lambda p, t: model.forward(CFG, p, t))


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, seed=1)


def greedy_reference(params, prompt, n):
    """Plain loop: run the model on the unpadded sequence so far, append the argmax."""
    ids = list(prompt)
    for _ in range(n):
        logits = _forward(params, np.asarray([ids], np.int32))
        ids.append(int(np.argmax(logits[0, -1])))
    return ids[len(prompt):]


@pytest.mark.slow  # compiles a decode loop per case
def test_greedy_matches_a_step_by_step_loop(params):
    prompt = [3, 14, 15, 9, 2]
    got = generate.generate(CFG, params, prompt, 8, temperature=0)
    assert got == greedy_reference(params, prompt, 8)
    assert len(set(got)) > 1  # not a degenerate constant output


@pytest.mark.slow  # compiles a decode loop
def test_cached_decoding_of_a_phi3_model_matches_a_step_by_step_loop():
    """Fused projections, partial rotary, a window shorter than the output and longrope
    (rows within its pre-training context: the short factors throughout) through the KV cache."""
    phi = dataclasses.replace(CFG, model_type="phi3", fused_projections=True, partial_rotary_factor=0.5,
                              sliding_window=4, layer_types=(SLIDING,) * 2, rope_scaling=RopeScaling(
                                  "longrope", 4.0, original_max_position_embeddings=24,
                                  short_factor=(1.5, 2.0), long_factor=(3.0, 5.0)))
    params = model.init_params(phi, seed=1)
    forward = jax.jit(lambda p, t: model.forward(phi, p, t))
    ids = prompt = [3, 14, 15, 9, 2]
    got = generate.generate(phi, params, prompt, 8, temperature=0)
    for _ in range(8):
        ids = ids + [int(np.argmax(forward(params, np.asarray([ids], np.int32))[0, -1]))]
    assert got == ids[len(prompt):] and len(set(got)) > 1


@pytest.mark.slow  # compiles a decode loop
def test_cached_decoding_of_a_llama4_model_matches_a_step_by_step_loop():
    """Chunks of 3 (shorter than the output) on a RoPE MoE layer, interleaved RoPE with the
    L2 q/k norm; a NoPE layer whose query temperature changes every 2 positions."""
    llama4 = dataclasses.replace(CFG, model_type="llama4_text", layer_types=(CHUNKED, FULL), attention_chunk_size=3,
                                 no_rope_layers=(1,), moe_layers=(0,), num_experts=3, num_experts_per_tok=1,
                                 moe_intermediate_size=24, shared_expert_intermediate_size=24, qk_l2_norm=True,
                                 attn_temperature_tuning=True, floor_scale=2.0, temperature_scale=0.5,
                                 rope_interleaved=True, moe_router="sigmoid_topk")
    params = model.init_params(llama4, seed=1)
    prompt = [3, 14, 15, 9, 2]
    got = generate.generate(llama4, params, prompt, 8, temperature=0)
    # The step-by-step loop in one causal forward: each token is the argmax after those before it.
    logits = jax.jit(functools.partial(model.forward, llama4))(params, np.asarray([prompt + got], np.int32))[0]
    assert got == np.argmax(logits[len(prompt) - 1:-1], axis=-1).tolist() and len(set(got)) > 1


@pytest.mark.slow  # compiles a decode loop per case
def test_top_k_one_is_greedy_and_sampling_is_seeded(params):
    prompt = [1, 2, 3]
    greedy = generate.generate(CFG, params, prompt, 8, temperature=0)
    assert generate.generate(CFG, params, prompt, 8, temperature=1.0, top_k=1, seed=5) == greedy
    a = generate.generate(CFG, params, prompt, 12, temperature=1.5, top_k=0, seed=0)
    assert a == generate.generate(CFG, params, prompt, 12, temperature=1.5, top_k=0, seed=0)
    samples = {tuple(generate.generate(CFG, params, prompt, 12, temperature=1.5, top_k=0, seed=s)) for s in range(4)}
    assert len(samples) > 1
    assert all(0 <= t < CFG.vocab_size for s in samples for t in s)


def test_top_k_restricts_to_the_k_likeliest(params):
    prompt = [7, 8]
    logits = np.asarray(_forward(params, np.asarray([prompt], np.int32)))[0, -1]
    top3 = set(np.argsort(logits)[-3:].tolist())
    firsts = {generate.generate(CFG, params, prompt, 1, temperature=5.0, top_k=3, seed=s)[0] for s in range(12)}
    assert firsts <= top3 and len(firsts) > 1


@pytest.mark.slow  # compiles a decode loop per case
def test_long_prompts_are_cut_to_the_context_and_eos_stops(params):
    prompt = list(range(40))  # longer than the 24-position context
    out = generate.generate(CFG, params, prompt, 6, temperature=0)
    assert out == greedy_reference(params, prompt[-18:], 6)
    eos = out[2]
    cut = generate.generate(CFG, params, prompt, 6, temperature=0, eos_id=eos)
    assert cut == out[:out.index(eos)]


def test_complete_decodes_text():
    cfg = tiny_config(vocab_size=257, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    text = generate.complete(cfg, model.init_params(cfg), ByteTokenizer(), "Hi", 5, temperature=0)
    assert isinstance(text, str) and len(text.encode("utf-8", "replace")) <= 5 * 3


# --- streamed sampling from a layer store ------------------------------------------------

SLIDING_TIED = tiny_config(vocab_size=61, num_hidden_layers=4, max_position_embeddings=24,
                           initializer_range=0.5, tie_word_embeddings=True, sliding_window=3,
                           layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"))


# Gemma 2's block on the cached path: sandwich norms, (1 + w) norms, GeGLU, scaled
# embeddings, query_pre_attn_scalar, and both soft-caps, set below the scores and logits of
# these small weights so that both bite (large weights make Gemma's greedy output constant).
GEMMA2_CAPPED = dataclasses.replace(
    SLIDING_TIED, model_type="gemma2", hidden_act="gelu_pytorch_tanh", rms_norm_offset=True, embed_scale=True,
    sandwich_norms=True, query_pre_attn_scalar=5.0, attn_logit_softcapping=0.005, final_logit_softcapping=0.1,
    rms_norm_eps=1e-6, initializer_range=0.02)


@pytest.fixture(scope="module", params=["untied-full", "tied-sliding"])
def store_model(request, tmp_path_factory):
    """(store dir, config, the store's master weights) of a fresh 4-block fp32 store."""
    import dataclasses

    import mtjax.store
    from mtjax.checkpoint import load_weights

    untied_full = dataclasses.replace(CFG, num_hidden_layers=4, layer_types=())
    cfg = {"untied-full": untied_full, "tied-sliding": SLIDING_TIED, "gemma2-capped": GEMMA2_CAPPED}[request.param]
    path = mtjax.store.init_store(cfg, tmp_path_factory.mktemp("sample") / "store", seed=3)
    loaded_cfg, params = load_weights(path)
    assert loaded_cfg == cfg
    return path, cfg, params


def _sampler(path):
    import mtjax.store
    from mtjax.stream.sample import StreamSampler

    return StreamSampler(mtjax.store.open(path))


@pytest.mark.slow  # compiles a decode loop per case
@pytest.mark.parametrize("store_model", ["untied-full", "tied-sliding", "gemma2-capped"], indirect=True)
def test_streamed_greedy_equals_in_memory_generate(store_model):
    path, cfg, params = store_model
    sampler = _sampler(path)
    for prompt, n in (([7], 10), (list(range(40)), 6), ([1, 2, 3, 4, 5, 6, 7, 8], 16)):
        want = generate.generate(cfg, params, prompt, n, temperature=0)
        assert sampler.generate(prompt, n, temperature=0) == want, prompt
        assert len(set(want)) > 1  # varied output, so a wrong cache or position shows
    eos = want[3]
    assert sampler.generate([1, 2, 3, 4, 5, 6, 7, 8], 16, temperature=0, eos_id=eos) == want[:want.index(eos)]


@pytest.mark.slow  # compiles a decode loop per case
def test_streamed_sampling_equals_in_memory_sampling(store_model):
    path, cfg, params = store_model
    sampler = _sampler(path)
    for seed, top_k in ((0, 0), (1, 5)):
        want = generate.generate(cfg, params, [5, 6], 10, temperature=1.5, top_k=top_k, seed=seed)
        assert sampler.generate([5, 6], 10, temperature=1.5, top_k=top_k, seed=seed) == want


@pytest.mark.slow  # compiles a decode loop per case
def test_streamed_sampling_holds_two_parts_and_the_kv_caches(store_model):
    """The device never holds the whole model: at most two parts' weights (the tied head
    reads the embedding) plus the caches, and the staging buffers are reused."""
    from mtjax import parts

    path, cfg, _ = store_model
    sampler = _sampler(path)
    n_prompt, n_new = 5, 8
    sampler.generate(list(range(n_prompt)), n_new, temperature=0)
    part_bytes = [parts.nbytes(sampler.schemas[n]) for n in sampler.names]
    cache_bytes = cfg.num_hidden_layers * 2 * 16 * cfg.num_key_value_heads * cfg.head_dim * 4  # 13 -> 16 slots
    assert sampler.ledger.peak <= cache_bytes + 2 * max(part_bytes)
    assert sampler.ledger.peak < cache_bytes + sum(part_bytes) - max(part_bytes)
    assert sampler.ledger.held == 0  # everything handed back
    assert sampler.pool.allocated <= 2 * 3  # two slots per shape (embed, block, head), for 6 x 8 part loads


def test_generate_command_streams_a_store(tmp_path, monkeypatch, capsys):
    """`mtjax generate STORE` never loads the whole model: it takes the streamed path."""
    import mtjax.store
    from mtjax import cli
    from mtjax import checkpoint

    cfg = tiny_config(vocab_size=257, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.5)
    path = mtjax.store.init_store(cfg, tmp_path / "store", seed=0)
    want = generate.complete(cfg, checkpoint.load_weights(path)[1], ByteTokenizer(), "Hi", 6, temperature=0)
    for where in (checkpoint, generate_command):  # the command holds its own name for it
        monkeypatch.setattr(where, "load_weights", lambda *a: pytest.fail("loaded the whole model"))
    assert cli.main(["generate", str(path), "--tokenizer", "bytes", "--prompt", "Hi", "--tokens", "6",
                     "--temperature", "0"]) == 0
    assert capsys.readouterr().out == "Hi" + want + "\n"


CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _bigram_params(cfg: ModelConfig, chain: dict[int, int]):
    """Weights under which a model's next token depends on the last token alone: for each
    `chain` pair, token a is followed by token b (every block adds nothing to the residual
    stream; the embedding of a is a basis direction the head reads as b)."""
    params = jax.tree.map(np.array, model.init_params(cfg, seed=1))
    for block in params["blocks"]:
        block["self_attn"]["o_proj"]["kernel"][:] = 0
        block["mlp"]["down_proj"]["kernel"][:] = 0
    params["embed"]["embedding"][:] = 0
    params["head"]["lm_head"]["kernel"][:] = 0
    params["head"]["norm"]["weight"][:] = 1
    for k, (a, b) in enumerate(chain.items()):
        params["embed"]["embedding"][a, k] = 1
        params["head"]["lm_head"]["kernel"][k, b] = 100  # far past any other logit at temperature 0.8
    return params


def test_chat_renders_the_template_and_stops_at_its_end_of_turn(tmp_path, capsys):
    """`generate --chat`: the model is given the user's message as the checkpoint's template
    renders it, and the answer is cut at the template's end of turn, <|im_end|>."""
    ckpt = tmp_path / "ckpt"
    qwen = Path(__file__).parent / "data" / "qwen2"
    (ckpt / "tokenizer.json").parent.mkdir()
    (ckpt / "tokenizer.json").write_bytes(gzip.decompress((qwen / "tokenizer.json.gz").read_bytes()))
    config = json.loads((qwen / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    tok = load_tokenizer(str(ckpt / "tokenizer.json"))
    want_prompt = tok.encode("<|im_start|>user\nIn the beginning?<|im_end|>\n<|im_start|>assistant\n")
    answer, end = tok.encode(" God created"), tok.encode("<|im_end|>")[0]
    prompt, stop = generate_command.chat_prompt(ckpt, tok, "In the beginning?")
    assert tok.encode(prompt) == want_prompt and stop == end
    # The model's answer to the rendered prompt's last token, then an end of turn, then more.
    cfg = dataclasses.replace(CFG, vocab_size=tok.vocab_size)
    chain = {want_prompt[-1]: answer[0], **dict(zip(answer, answer[1:] + [end])), end: answer[0]}
    hf.save_params(cfg, _bigram_params(cfg, chain), ckpt)
    assert cli.main(["generate", str(ckpt), "--chat", "--prompt", "In the beginning?", "--tokens", "6"]) == 0
    assert capsys.readouterr().out == " God created\n"


@pytest.mark.parametrize("prompt, tokens, says", [
    ("x" * 30, 1, "--prompt (30 tokens) and --tokens 1 need 31 positions, more than the model's context of 24 "
                  "(max_position_embeddings); shorten --prompt to fewer than 24 tokens"),
    ("Hi", 10**9, "--prompt (2 tokens) and --tokens 1000000000 need 1,000,000,002 positions, more than the "
                  "model's context of 24 (max_position_embeddings); lower --tokens to 22 or less"),
    ("", 24, "--prompt (1 token) and --tokens 24 need 25 positions"),  # an empty prompt starts from one token
])
def test_generate_refuses_what_does_not_fit_the_context(tmp_path, monkeypatch, capsys, prompt, tokens, says):
    """A prompt and --tokens that together pass the model's context are one line saying
    what to lower, before any weight is read (the library's `generate` cuts the prompt instead)."""
    ckpt = tmp_path / "ckpt"
    hf.save_params(CFG, model.init_params(CFG, seed=1), ckpt)
    monkeypatch.setattr(generate_command, "load_weights", lambda *a: pytest.fail("read the weights"))
    assert cli.main(["generate", str(ckpt), "--tokenizer", "bytes", "--prompt", prompt, "--tokens", str(tokens)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mtjax generate: error: {says}") and err.count("\n") == 1, err


@pytest.mark.slow  # compiles a decode loop
def test_sampling_in_pieces_gives_the_same_tokens(params):
    """The loop runs `progress_tokens` positions per call (a progress bar moves between
    calls); the key carries over, so sampled tokens are those of a single call."""
    whole = generate.generate(CFG, params, [3, 14], 20, temperature=1.0, top_k=0, seed=5, progress_tokens=20)
    assert generate.generate(CFG, params, [3, 14], 20, temperature=1.0, top_k=0, seed=5, progress_tokens=3) == whole
    assert len(set(whole)) > 1
