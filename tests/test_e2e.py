"""The researcher's whole path through the real commands, as README.md shows it.

A tiny random Qwen2 checkpoint (with the real Qwen2 tokenizer beside it) stands in for
a downloaded one: import it into a layer store, prepare text with its tokenizer (and
with `bytes`), fine-tune it streaming from the store on disk with periodic evaluation
and checkpoints, kill the run with SIGKILL after a commit and resume it by running the
same command again, then eval, generate, plot and export. Every command runs in a fresh
interpreter (`python -m mtjax`), in a working directory of its own, with the relative
paths the README uses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import matplotlib.image
import numpy as np
import pytest

from mtjax import checkpoint, data, generate, hf, model
from mtjax.optim import OptimConfig, lr_at

pytestmark = pytest.mark.slow  # the whole command-line path, several mtjax processes

DATA = Path(__file__).parent / "data"

# The commands of README.md's "From text to a fine-tuned model", in order.
IMPORT = ["import", "qwen2-tiny", "runs/genesis/store", "--compute-dtype", "float32"]
PREPARE = ["data", "prepare", "genesis.txt", "--out", "data/genesis", "--tokenizer", "qwen2-tiny",
           "--val-fraction", "0.1"]
PREPARE_BYTES = ["data", "prepare", "genesis.txt", "--out", "data/genesis-bytes", "--tokenizer", "bytes"]
TRAIN = ["train", "--model.hf_config=qwen2-tiny", "--data.dataset=data/genesis", "--data.seq_len=32",
         "--data.batch_size=2", "--optim.lr=3e-3", "--optim.warmup_steps=1", "--optim.decay_steps=5",
         "--store.compute=disk", "--store.master=disk", "--store.opt=disk", "--run.dir=runs/genesis", "--run.steps=6",
         "--run.log_every=1", "--run.eval_every=2", "--run.eval_batches=1", "--run.checkpoint_every=2",
         "--run.sample_tokens=0", "--run.resume=true"]
EVAL = ["eval", "runs/genesis/store", "data/genesis", "--seq-len", "32", "--batch-size", "2", "--batches", "1"]
GENERATE = ["generate", "runs/genesis/store", "--prompt", "In the beginning", "--tokens", "12", "--temperature", "0"]
PLOT = ["plot", "runs/genesis"]
EXPORT = ["export", "runs/genesis/store", "genesis-hf"]


def start(cwd: Path, args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mtjax", *args], cwd=cwd, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, **kwargs)


def mtjax(cwd: Path, *commands: list[str]) -> list[tuple[str, str]]:
    """Run the commands side by side (they are independent; most of their time is
    interpreter start-up and disk waits); (stdout, stderr) of each, all succeeded."""
    procs = [start(cwd, args, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for args in commands]
    outs = [p.communicate(timeout=300) for p in procs]
    for args, p, (_, err) in zip(commands, procs, outs):
        assert p.returncode == 0, (args, err[-3000:])
    return outs


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def per_step(run_dir: Path, key: str) -> dict[int, float]:
    """`key` per step; a step run again after a resume overwrites the killed run's record."""
    return {r["step"]: r[key] for r in records(run_dir) if key in r}


def train_killed_after_a_commit(cwd: Path) -> tuple[int, str]:
    """Start TRAIN, SIGKILL it once a checkpoint is committed (a step after it is logged);
    (its exit status, its log)."""
    log = cwd / "killed-train.log"
    with log.open("w") as f:
        proc = start(cwd, TRAIN, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if max(per_step(cwd / "runs/genesis", "loss"), default=0) >= 3:
                    break  # step 3 ran, so the commit at step 2 is done
            except json.JSONDecodeError:
                pass  # caught a line half written
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    return proc.returncode, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory like a user's: a checkpoint with its tokenizer and a text file."""
    import hf_models

    cwd = tmp_path_factory.mktemp("e2e")
    # Qwen2's embedding size (151,936 rows) so that every id of the real tokenizer fits, tied
    # to the head as in the small Qwen2 models; narrow, so each step moves few bytes.
    ckpt, _ = hf_models.checkpoint(cwd, "qwen2", vocab_size=151936, hidden_size=16, intermediate_size=32,
                                   num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    ckpt.rename(cwd / "qwen2-tiny")
    for f in (DATA / "qwen2").iterdir():
        shutil.copy(f, cwd / "qwen2-tiny" / f.name)
    shutil.copy(DATA / "kjv-genesis.txt", cwd / "genesis.txt")
    return cwd


def test_from_text_to_a_fine_tuned_model(workdir):
    cwd = workdir
    straight = [[a.replace("runs/genesis", "runs/straight") for a in c] for c in (IMPORT, TRAIN)]
    _, (out, _), _, _ = mtjax(cwd, IMPORT, PREPARE, PREPARE_BYTES, straight[0])
    meta = json.loads((cwd / "data/genesis/meta.json").read_text())
    assert meta["vocab_size"] == 151936 and meta["dtype"] == "uint32" and "8,136 tokens" in out
    text = (cwd / "genesis.txt").read_bytes()
    meta_bytes = json.loads((cwd / "data/genesis-bytes/meta.json").read_text())
    assert meta_bytes["num_tokens"] == len(text) + 1 and meta_bytes["vocab_size"] == 257  # bytes and one EOS

    # Beside it, the uninterrupted reference: the same command in a run directory of its own.
    reference = start(cwd, straight[1], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    status, log = train_killed_after_a_commit(cwd)
    assert status == -signal.SIGKILL, log  # killed, not finished
    assert 3 <= max(per_step(cwd / "runs/genesis", "loss")) < 6
    [(_, err)] = mtjax(cwd, TRAIN)  # the same command again resumes from the last commit (step 2 or 4)
    assert re.search(r"steps [35]-6 ", err), err
    # It says where the weights come from and logs each step's learning rate.
    assert re.search(r"\nmtjax: weights: resumed from runs/genesis/store at step [24]\n", err), err
    last_lr = lr_at(OptimConfig(lr=3e-3, warmup_steps=1, decay_steps=5), 6)  # TRAIN's schedule at its last step
    assert re.search(rf"\nstep      6/6  loss \S+  lr {last_lr:.3g}  gnorm ", err) and "warning" not in err, err
    assert reference.wait(timeout=300) == 0, reference.stderr.read()[-3000:]
    assert "\nmtjax: weights: the layer store runs/straight/store as imported" in reference.stderr.read()
    resumed, want = per_step(cwd / "runs/genesis", "loss"), per_step(cwd / "runs/straight", "loss")
    assert sorted(resumed) == list(range(1, 7)) and resumed == want  # bit-identical per-step losses
    vals = per_step(cwd / "runs/genesis", "val_loss")
    assert vals == per_step(cwd / "runs/straight", "val_loss") and sorted(vals) == [2, 4, 6]
    assert want[6] < want[1]  # it learns
    cfg, params = checkpoint.load_weights(cwd / "runs/genesis/store")
    _, params_straight = checkpoint.load_weights(cwd / "runs/straight/store")
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params_straight)):
        np.testing.assert_array_equal(a, b)

    (evaluated, _), (generated, _), _, _ = mtjax(cwd, EVAL, GENERATE, PLOT, EXPORT)
    # eval: the store's validation loss, as the run's last evaluation on the same batch
    line = evaluated.strip()
    assert line.startswith("val loss ") and "perplexity" in line, line
    loss, ppl = float(line.split()[2]), float(line.split()[4])
    assert loss == pytest.approx(vals[6], abs=1e-4) and ppl == pytest.approx(np.exp(loss), rel=1e-3)

    # generate, streamed from the store: the same text as sampling the weights in memory
    tok = data.load_tokenizer(str(cwd / "qwen2-tiny"))
    want_text = generate.complete(cfg, params, tok, "In the beginning", 12, temperature=0)
    assert generated == "In the beginning" + want_text + "\n"

    # plot: a PNG that matplotlib reads back
    image = matplotlib.image.imread(cwd / "runs/genesis/charts.png")
    assert image.ndim == 3 and image.shape[0] > 100

    # export: transformers loads it and its logits are ours
    import torch
    import transformers

    hf_cfg, _ = hf.load_params(cwd / "genesis-hf")
    assert hf_cfg.vocab_size == cfg.vocab_size and hf_cfg.tie_word_embeddings
    ids = np.asarray([tok.encode("And God said, Let there be light")], np.int32)
    ours = np.asarray(model.forward(cfg, params, ids))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(cwd / "genesis-hf", dtype=torch.float32)
    with torch.no_grad():
        logits = theirs(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(logits, ours, atol=2e-4, rtol=1e-4)


def test_readme_shows_exactly_these_commands():
    """README.md's "From text to a fine-tuned model" block is the command list above."""
    import shlex

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## From text to a fine-tuned model\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
    assert commands == [["mtjax", *c] for c in (IMPORT, PREPARE, PREPARE_BYTES, TRAIN, EVAL, GENERATE, PLOT, EXPORT)]


def test_readme_chat_eval_works_as_written(workdir):
    """README.md's "Fine-tuning on chat data": its `data prepare` and `eval` commands as
    written, on the shipped chat data, with the tiny Qwen2 checkpoint (and its template)
    for $CKPT and, as the fine-tuned $R/final, the same checkpoint (a real fine-tune of
    the 494M model is no test). The held-out split holds fewer rows than eval's default
    8 batches of 8: eval uses the rows there are and says so."""
    import shlex

    cwd = workdir
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("## Fine-tuning on chat data\n", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line, comments=True) for line in block.replace("\\\n", " ").splitlines()]
    variables = dict(line[0].split("=", 1) for line in lines if len(line) == 1 and "=" in line[0])
    commands = {line[1]: line[2:] for line in lines if line[:1] == ["mtjax"]}
    assert variables.keys() == {"CKPT", "R"} and {"data", "eval"} <= commands.keys(), lines
    for where in (cwd / variables["CKPT"], cwd / variables["R"] / "final"):
        shutil.copytree(cwd / "qwen2-tiny", where)
        config = json.loads((where / "config.json").read_text())
        (where / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))  # Qwen2.5's
    (cwd / "experiments/data").mkdir(parents=True)
    shutil.copy(Path(__file__).parents[1] / "experiments/data/kjv-chat.jsonl.gz", cwd / "experiments/data")

    def expand(args):
        return [a.replace("$CKPT", variables["CKPT"]).replace("$R", variables["R"]) for a in args]

    mtjax(cwd, ["data", *expand(commands["data"])])
    (line, note), = mtjax(cwd, ["eval", *expand(commands["eval"])])
    meta = json.loads((cwd / "data/kjv-chat/meta.json").read_text())
    start, stop = meta["splits"]["val"]
    rows = (stop - start) // 1024
    assert 0 < rows < 64, meta  # fewer held-out rows than 8 batches of 8
    batches, per = (rows // min(rows, 8), min(rows, 8))
    assert note.strip() == (f"mtjax eval: the val split holds {rows:,} rows of 1024 tokens: evaluated {batches} "
                            f"batch{'es' * (batches != 1)} of {per} row{'s' * (per != 1)} (asked for 8 batches of "
                            "8 rows)"), note
    assert line.startswith("val loss ") and "tokens the loss mask keeps" in line, line
