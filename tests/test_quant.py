"""A quantized frozen base (mtjax.quant, mtjax.precision.Quantized): int8 and NF4.

The formats are checked against a numpy reference written from the QLoRA paper's
definitions (Dettmers et al. 2023, eq. 1 and section 3 "4-bit NormalFloat"), with the
16 NF4 levels as bitsandbytes publishes them: the packed bytes bit for bit and the
decoded weights exactly. bitsandbytes itself is not installed here (it is not compared).
A frozen quantized base trains exactly as its decoded fp32 base does, a streamed run
equals the reference trainer, and the bytes a step stages are the quantized ones.
"""

from __future__ import annotations

import dataclasses
import io
import math

import numpy as np
import pytest

import mtjax.store
from mtjax import checkpoint, cli, config, generate, hf, model, parts, precision, quant, treepath
from mtjax import run as run_lib
from mtjax.config import StoreConfig, StreamConfig
from mtjax.model_config import ConfigError, load_hf_config
from mtjax.optim import OptimConfig, make_optimizer
from mtjax.plan import BUILTIN, StepShape, estimate, report
from mtjax.reference import ReferenceTrainer
from mtjax.store import store as store_mod
from mtjax.store.errors import StoreError
from mtjax.stream import StreamEngine
from mtjax.stream.sample import StreamSampler

import hf_models
from conftest import ONE_KV_HEAD, tiny_config, token_batches
from test_schedule import counted_steps

BASE = ("block.*/*.kernel",)  # every linear weight of every block: the frozen base
BATCH, SEQ = 2, 8
# The NF4 levels as bitsandbytes lists them (functional.py, get_4bit_type "nf4"), typed out again.
BNB_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
           -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
           0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
           0.7229568362236023, 1.0]


# --- the numpy reference, from the paper ---------------------------------------------

def ref_int8(kernel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed bytes, decoded fp32 kernel): absmax quantization X_int8 = round(c * X),
    c = 127 / absmax, per output channel (row of W = kernel.T); dequant X_int8 / c,
    as X_int8 * scale, the scale absmax * fp32(1 / 127) stored."""
    w = kernel.T.astype(np.float32)  # [out, in]
    absmax = np.abs(w).max(axis=1)
    c = np.where(absmax > 0, np.float32(127) / np.where(absmax > 0, absmax, 1), 1).astype(np.float32)
    codes = np.clip(np.rint(c[:, None] * w), -127, 127).astype(np.int8)
    scale = (absmax * np.float32(1 / 127)).astype("<f4")
    packed = np.concatenate([codes.T.reshape(-1).view(np.uint8), scale.view(np.uint8)])
    return packed, (codes.astype(np.float32) * scale[:, None]).T


def ref_nf4(kernel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(packed bytes, decoded fp32 kernel): blocks of 64 consecutive weights of one output
    channel (the input axis zero-padded to a multiple of 64), each value / its block's
    absmax mapped to the nearest NF4 level (distances in float64), indices packed two a
    byte along the input axis, first high; dequant level * absmax."""
    levels = np.array(BNB_NF4, np.float32)
    rows, out = kernel.shape
    padded = np.zeros((-(-rows // 64) * 64, out), np.float32)
    padded[:rows] = kernel
    blocks = padded.reshape(-1, 64, out)
    absmax = np.abs(blocks).max(axis=1)
    x = blocks / np.where(absmax > 0, absmax, 1)[:, None, :]
    index = np.abs(x.astype(np.float64)[..., None] - levels.astype(np.float64)).argmin(axis=-1).astype(np.uint8)
    packed = np.concatenate([((index[:, 0::2] << 4) | index[:, 1::2]).reshape(-1),
                             absmax.astype("<f4").view(np.uint8).reshape(-1)])
    return packed, (levels[index] * absmax[:, None, :]).reshape(-1, out)[:rows]


REFERENCE = {"int8": ref_int8, "nf4": ref_nf4}


def _kernels():
    rng = np.random.default_rng(0)
    yield rng.normal(0, 0.02, (96, 64)).astype(np.float32)  # whole blocks
    odd = rng.standard_t(3, (101, 11)).astype(np.float32)  # heavy tails; 101 inputs: the last block padded
    odd[:, 3] = 0  # an all-zero output channel
    odd[5:30, 7] *= 1e-30  # tiny ones
    yield odd
    yield np.zeros((64, 2), np.float32)  # every block zero


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_packed_bytes_and_decoded_weights_equal_the_papers_definition(fmt):
    assert quant.NF4_LEVELS.tolist() == np.array(BNB_NF4, np.float32).tolist()
    for kernel in _kernels():
        want_bytes, want = REFERENCE[fmt](kernel)
        got_bytes = quant.to_host(fmt, kernel)
        assert got_bytes.dtype == np.uint8 and got_bytes.size == quant.nbytes(fmt, kernel.shape)
        np.testing.assert_array_equal(got_bytes, want_bytes)
        np.testing.assert_array_equal(quant.from_host(fmt, got_bytes, kernel.shape), want)
        # Decoded into bf16: the fp32 value rounded once.
        bf16 = quant.from_host(fmt, got_bytes, kernel.shape, precision.BF16)
        np.testing.assert_array_equal(bf16, precision.reference(want, precision.BF16).astype(np.float32))


def test_the_formats_sizes_are_a_half_and_under_a_third_of_bf16():
    shape = (4096, 14336)  # a Llama-3-8B MLP kernel
    bf16 = 2 * math.prod(shape)
    assert bf16 / quant.nbytes("int8", shape) == pytest.approx(2, rel=1e-3)
    assert bf16 / quant.nbytes("nf4", shape) == pytest.approx(2 / (0.5 + 4 / 64))  # 4.5 bits a weight: 3.56x


# --- the policy, training and streaming -----------------------------------------------

def _cfg(fmt, **kw):
    return tiny_config(num_hidden_layers=3, **ONE_KV_HEAD, freeze=BASE, base_format=fmt, **kw)


def _decoded_base(cfg, params):
    """`params` with each quantized kernel replaced by the reference's decoded weights."""
    flat = treepath.flatten(params)
    for i in range(cfg.num_hidden_layers):
        for n, leaf in parts.leaves(cfg, f"block.{i}").items():
            if isinstance(leaf.compute, precision.Quantized):
                key = f"blocks.{i}.{n}"
                flat[key] = REFERENCE[cfg.base_format](np.asarray(flat[key]))[1]
    return treepath.unflatten(params, flat)


def test_only_frozen_block_kernels_are_quantized():
    cfg = tiny_config(freeze=("embed", "block.0/mlp.*", "block.1"), base_format="int8")
    for p in parts.parts(cfg):
        for n, leaf in parts.leaves(cfg, p.name).items():
            quantized = isinstance(leaf.compute, precision.Quantized)
            assert quantized == (p.name.is_block and leaf.role == "frozen" and n.endswith("kernel")), (p.name, n)
            assert parts.schema(cfg, p.name, "compute")[n].dtype == (np.uint8 if quantized else np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_a_quantized_base_trains_as_its_decoded_fp32_base(fmt):
    cfg = _cfg(fmt)
    plain = dataclasses.replace(cfg, base_format="compute")
    opt = OptimConfig(lr=1e-3, warmup_steps=0)
    params = model.init_params(cfg, seed=0)
    decoded = _decoded_base(cfg, params)
    ours, theirs = StreamEngine(cfg, params, opt), StreamEngine(plain, decoded, opt)
    for batch in token_batches(cfg.vocab_size, (1, BATCH, SEQ), 3):
        assert ours.step(batch)["loss"] == pytest.approx(theirs.step(batch)["loss"], abs=1e-6)
    got, want, start = (treepath.flatten(t) for t in (ours.params(), theirs.params(), decoded))
    for name, w in got.items():
        if np.asarray(w).ndim == 2 and name.startswith("blocks."):  # the frozen base: its decoded weights, exactly
            np.testing.assert_array_equal(np.asarray(w), np.asarray(start[name]), err_msg=name)
        else:
            b = np.asarray(want[name], np.float64)
            assert np.linalg.norm(np.asarray(w, np.float64) - b) <= 1e-5 * np.linalg.norm(b), name
    ours.close(), theirs.close()


@pytest.mark.slow
def test_a_streamed_quantized_base_equals_the_reference_trainer(make_store):
    cfg = _cfg("nf4", tie_word_embeddings=True)
    opt = OptimConfig(lr=1e-3, warmup_steps=0)
    params = model.init_params(cfg, seed=0)
    store = make_store(cfg, make_optimizer(opt))
    engine = StreamEngine(cfg, params, opt, StreamConfig(keep_every=2), StoreConfig(master="disk", opt="disk"),
                          store=store)
    reference = ReferenceTrainer(cfg, params, opt)
    for batch in token_batches(cfg.vocab_size, (2, BATCH, SEQ), 3):
        assert engine.step(batch)["loss"] == pytest.approx(reference.step(batch)["loss"], abs=1e-5)
    ref = treepath.flatten(reference.params)
    for name, w in treepath.flatten(engine.params()).items():
        b = np.asarray(ref[name], np.float64)
        assert np.linalg.norm(np.asarray(w, np.float64) - b) <= 1e-5 * np.linalg.norm(b), name
    engine.close()
    store.close()


@pytest.mark.slow
def test_a_step_stages_the_quantized_bytes_its_description_counts():
    cfg = _cfg("nf4", compute_dtype="bfloat16")
    opt = OptimConfig(lr=1e-3, warmup_steps=0)
    engine = StreamEngine(cfg, model.init_params(cfg, seed=0), opt, batch_shape=(BATCH, SEQ))
    s = engine.plan(BATCH, SEQ, 1)
    packed, plain = parts.quantized_bytes(cfg)
    block = sum(s.part_bytes[f"block.{i}"].compute for i in range(cfg.num_hidden_layers))
    norms = sum(math.prod(leaf.shape) * 2 for i in range(cfg.num_hidden_layers)
                for leaf in parts.leaves(cfg, f"block.{i}").values() if not isinstance(leaf.compute, precision.Quantized))
    assert block == packed + norms and packed < plain
    counts = counted_steps(engine, cfg.vocab_size, (1, BATCH, SEQ), 1)
    assert counts.bytes["h2d_weights"] == s.traffic.h2d_weights
    engine.close()


@pytest.mark.parametrize("fmt,ratio,step", [("int8", 1.99, 1.95), ("nf4", 3.55, 3.4)])
def test_the_planner_streams_the_base_2x_and_3_5x_smaller_and_says_so(fmt, ratio, step):
    """Llama-3-70B, its blocks' kernels frozen: `ratio` their bytes' fall, `step` the step's
    host-to-device bytes' (the embedding, head and norms stay bf16)."""
    cfg = load_hf_config("experiments/hf_configs/llama-3-70b.json", compute_dtype="bfloat16", freeze=BASE)
    shape, tx = StepShape(1, 4096, 1), make_optimizer(OptimConfig())
    plain = estimate(cfg, StreamConfig(), StoreConfig(), shape, BUILTIN["h200"], tx=tx)
    quantized = estimate(dataclasses.replace(cfg, base_format=fmt), StreamConfig(), StoreConfig(), shape,
                         BUILTIN["h200"], tx=tx)
    base = sum(math.prod(leaf.shape) * 2 for leaf in parts.leaves(cfg, "block.0").values()
               if leaf.name.endswith("kernel")) * cfg.num_hidden_layers
    saved = plain.state.compute - quantized.state.compute
    assert saved > base * (1 - 1 / ratio)  # the kernels' bytes fall by `ratio` or more
    assert plain.traffic.h2d / quantized.traffic.h2d >= step
    line = [x for x in report.text(quantized).splitlines() if "frozen base" in x]
    assert len(line) == 1 and fmt in line[0] and float(line[0].split("x less")[0].split()[-1]) >= ratio


# --- bad input ------------------------------------------------------------------------

@pytest.mark.parametrize("kw,words", [
    (dict(base_format="int4"), "model.base_format must be one of compute, int8, nf4"),
    (dict(base_format="nf4"), "freezes none"),
    (dict(base_format="nf4", freeze=("embed",)), "freezes none")])
def test_a_bad_base_format_is_refused_in_one_line(kw, words):
    with pytest.raises(ConfigError, match=words) as e:
        parts.check_roles(tiny_config(**kw))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("freeze", [(), ("block.*/mlp.*",)])
def test_a_quantized_leaf_asked_to_train_is_refused_in_one_line(make_store, freeze):
    cfg = _cfg("int8")
    store = make_store(cfg, make_optimizer(OptimConfig()))
    root = store.root
    store.close()
    with pytest.raises(StoreError, match=r"block.0/\S+ quantized \(int8\), which cannot be trained") as e:
        mtjax.store.open(root, config=dataclasses.replace(cfg, freeze=freeze, base_format="compute"))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_mtjax_import_base_format_writes_a_quantized_frozen_base(tmp_path, capsys):
    ckpt = hf_models.checkpoint(tmp_path, "llama", vocab_size=128)[0]
    store_dir = tmp_path / "store"
    assert cli.main(["import", str(ckpt), str(store_dir), "--compute-dtype", "float32", "--base-format", "nf4"]) == 0
    assert "(frozen block.*/*.kernel; base format nf4)" in capsys.readouterr().out
    _, params = hf.load_params(ckpt)
    with mtjax.store.open(store_dir) as store:
        cfg = store.config
        assert (cfg.base_format, cfg.freeze) == ("nf4", BASE)
        assert not parts.schema(cfg, "block.0", "master").keys() & {n for n in parts.leaves(cfg, "block.0")
                                                                     if n.endswith("kernel")}
        weights = store_mod.weights(store, "block.0")
    for n, w in treepath.flatten(params["blocks"][0]).items():
        want = ref_nf4(np.asarray(w))[1] if n.endswith("kernel") else np.asarray(w)
        np.testing.assert_array_equal(np.asarray(weights[n]), want, err_msg=n)
    # Refused in one line, nothing written: a base format with nothing frozen for it.
    bad = tmp_path / "bad"
    assert cli.main(["import", str(ckpt), str(bad), "--base-format", "int8", "--freeze", "embed"]) == 2
    err = capsys.readouterr().err.strip()
    assert "freezes none" in err and "\n" not in err and not bad.exists()


@pytest.mark.slow
def test_a_run_trains_an_imported_nf4_store_leaving_its_base_as_imported(tmp_path):
    """The README's path: `mtjax import --base-format nf4`, then `mtjax train` on that store
    with the same freeze and base format; the quantized kernels come out byte-identical."""
    ckpt = hf_models.checkpoint(tmp_path, "qwen2", vocab_size=300)[0]
    store_dir = tmp_path / "store"
    assert cli.main(["import", str(ckpt), str(store_dir), "--compute-dtype", "float32", "--base-format", "nf4"]) == 0
    with mtjax.store.open(store_dir) as store:
        before = store.read("block.1", "compute").result()
        before = {n: np.array(a) for n, a in before.items()}
    args = ["--data.seq_len=32", "--data.batch_size=2", "--run.eval_every=0", "--run.sample_prompt=",
            "--optim.warmup_steps=0", "--stream.engine=stream", f"--model.hf_config={ckpt}",
            "--model.compute_dtype=float32", f"--model.freeze={BASE[0]}", "--model.base_format=nf4",
            f"--store.path={store_dir}", "--store.master=disk", "--store.opt=disk", f"--run.dir={tmp_path / 'run'}",
            "--run.steps=2"]
    summary = run_lib.train(config.load(None, args), io.StringIO())
    assert np.isfinite(summary["first_loss"])
    with mtjax.store.open(store_dir) as store:
        assert store.step == 2
        after = store.read("block.1", "compute").result()
        master = store.read("block.1", "master").result()
    for n, a in before.items():
        if a.dtype == np.uint8:
            np.testing.assert_array_equal(np.asarray(after[n]), a, err_msg=n)
    assert any(not np.array_equal(np.asarray(after[n]), before[n]) for n in master)  # the rest trained
    # Sampling streamed from the store decodes the base as training did: the same greedy
    # tokens as the in-memory loop over the store's weights (the base decoded on the host).
    with mtjax.store.open(store_dir) as store:
        params = checkpoint.read_params(store)
        cfg = store.config
        streamed = StreamSampler(store).generate([1, 2, 3], 6, temperature=0)
    assert streamed == generate.generate(cfg, params, [1, 2, 3], 6, temperature=0)
