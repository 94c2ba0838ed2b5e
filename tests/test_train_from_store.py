"""Training from a store filled by `mtjax import`: the imported weights are the start,
the store is never deleted, and a second run over it must say --run.resume."""

import os

import numpy as np
import pytest

import hf_models
import mtjax.store
from mtjax import cli, config, data, hf
from mtjax import run as run_lib
from mtjax.reference import loss_fn

pytestmark = pytest.mark.slow  # mtjax processes over a store


def test_training_starts_from_an_imported_store_and_keeps_it(tmp_path):
    ckpt, _ = hf_models.checkpoint(tmp_path, "llama", vocab_size=300)
    store_dir = tmp_path / "store"
    assert cli.main(["import", str(ckpt), str(store_dir), "--compute-dtype", "float32"]) == 0
    args = ["--data.seq_len=32", "--data.batch_size=2", "--run.steps=2", "--run.eval_every=0",
            "--run.sample_prompt=", f"--model.hf_config={ckpt}", f"--store.path={store_dir}",
            "--store.master=disk", "--store.opt=disk", f"--run.dir={tmp_path / 'run'}"]
    quiet = open(os.devnull, "w")
    summary = run_lib.train(config.load(None, args), quiet)
    cfg, params = hf.load_params(ckpt)
    first = data.Loader(data.Dataset(tmp_path / "run" / "data"), "train", 32, 2).next()[0]
    np.testing.assert_allclose(summary["first_loss"], float(loss_fn(cfg, params, first)), rtol=1e-5)
    with mtjax.store.open(store_dir) as store:  # still there, committed at the last step
        assert store.step == 2
    with pytest.raises(config.ConfigError, match="--run.resume=true"):
        run_lib.train(config.load(None, args), quiet)
    more = run_lib.train(config.load(None, [*args, "--run.steps=3", "--run.resume=true"]), quiet)
    assert more["steps"] == 1
