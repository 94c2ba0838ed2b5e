"""model.compute_dtype=auto (mtjax.plan.compute_dtype): bfloat16 on an accelerator and on a
CPU whose probe finds bf16 matmuls at least MARGIN times faster than fp32, else float32;
`mtjax plan` says which and why, a run records the resolved dtype (config.yaml, store) and
a resume compares that, and bad values are refused in one line."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from conftest import TINY_MODEL_ARGS

from mtjax import cli, config
from mtjax import run as run_lib
from mtjax import store as store_lib
from mtjax.plan import BUILTIN, compute_dtype, machine

CPU = BUILTIN["cpu-2core"]
FAST = dataclasses.replace(CPU, name="bf16-fast", matmul_flops_fp32=100e9, matmul_flops_bf16=190e9)
SLOW = dataclasses.replace(CPU, name="bf16-slow", matmul_flops_fp32=100e9, matmul_flops_bf16=100e9)
RUN = [*TINY_MODEL_ARGS, "--data.seq_len=32", "--data.batch_size=2", "--optim.warmup_steps=0", "--run.steps=1",
       "--run.eval_every=0", "--run.sample_tokens=0"]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own profile cache, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "mtjax"


def this_machine(cache, profile):
    """`profile` as this machine's cached probe (read instead of probing)."""
    profile.save(cache / f"hardware-{machine.key()}.json")


def test_auto_is_bf16_where_it_is_faster_else_fp32_and_bf16_on_an_accelerator():
    assert compute_dtype.choose(FAST)[0] == "bfloat16"
    assert compute_dtype.choose(SLOW)[0] == "float32"
    edge = dataclasses.replace(SLOW, matmul_flops_bf16=SLOW.matmul_flops_fp32 * (compute_dtype.MARGIN - 0.01))
    assert compute_dtype.choose(edge)[0] == "float32"  # faster, but not by the margin
    assert compute_dtype.choose(dataclasses.replace(BUILTIN["h200"], matmul_flops_bf16=1.0))[0] == "bfloat16"


def test_resolve_replaces_auto_only():
    exp = config.load(None, ["--model.compute_dtype=auto"])
    got, line = compute_dtype.resolve(exp, SLOW)
    assert config.model_config(got).compute_dtype == "float32" and "float32" in line and "1.00x" in line
    got, line = compute_dtype.resolve(exp, FAST)
    assert config.model_config(got).compute_dtype == "bfloat16" and "1.90x" in line
    given = config.load(None, ["--model.compute_dtype=float32"])
    assert compute_dtype.resolve(given, FAST) == (given, None)
    # Sized before a backend starts (a GPU's pinned pool): the widest auto may become.
    assert config.model_config(compute_dtype.widest(exp)).compute_dtype == "float32"
    assert compute_dtype.widest(given) is given
    with pytest.raises(config.ConfigError, match="needs it set: model.compute_dtype float32, bfloat16 or float16$"):
        config.model_config(exp)  # unresolved: one line naming every value, not a ModelConfig error


@pytest.mark.parametrize("profile, dtype", [(FAST, "bfloat16"), (SLOW, "float32")])
def test_plan_resolves_auto_for_the_profile_and_says_why(tmp_path, capsys, profile, dtype):
    yaml = tmp_path / "exp.yaml"
    yaml.write_text("model:\n  compute_dtype: auto\n")
    hw = profile.save(tmp_path / f"{profile.name}.json")
    assert cli.main(["plan", str(yaml), "--hardware", str(hw)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "model.compute_dtype=auto" in ln]
    assert len(lines) == 1 and f"compute dtype {dtype}" in lines[0] and profile.name in lines[0]
    assert cli.main(["plan", str(yaml), "--hardware", str(hw), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["compute_dtype"] == dtype


def test_plan_of_an_hf_config_with_auto_for_an_accelerator_is_bf16(capsys):
    config_json = os.path.join(os.path.dirname(__file__), "..", "experiments", "hf_configs", "llama-3-70b.json")
    assert cli.main(["plan", config_json, "--compute-dtype", "auto", "--hardware", "h200", "--json"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["compute_dtype"] == "bfloat16" and "an accelerator" in model["compute_dtype_choice"]


def test_plan_of_a_given_dtype_says_nothing_of_auto(tmp_path, capsys):
    yaml = tmp_path / "exp.yaml"
    yaml.write_text("model:\n  compute_dtype: float32\n")
    assert cli.main(["plan", str(yaml), "--hardware", str(FAST.save(tmp_path / "fast.json"))]) == 0
    assert "model.compute_dtype=auto" not in capsys.readouterr().out


@pytest.mark.slow  # two tiny runs
def test_a_run_records_the_resolved_dtype_and_a_resume_compares_it(tmp_path, cache):
    quiet = open(os.devnull, "w")
    args = [*RUN, "--model.compute_dtype=auto", f"--run.dir={tmp_path / 'run'}"]
    this_machine(cache, FAST)
    run_lib.train(config.load(None, args), quiet)
    assert config.model_config(config.load(tmp_path / "run" / "config.yaml")).compute_dtype == "bfloat16"
    with store_lib.open(tmp_path / "run" / "store") as store:
        assert store.config.compute_dtype == "bfloat16"
    this_machine(cache, SLOW)  # the same run resumed where auto chooses fp32: refused, not retyped
    with pytest.raises(store_lib.StoreError, match="compute_dtype"):
        run_lib.train(config.load(None, [*args, "--run.resume=true", "--run.steps=2"]), quiet)


def mtjax(tmp_path, *args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    return subprocess.run([sys.executable, "-m", "mtjax", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow  # a training run in a subprocess
def test_the_command_line_trains_with_auto_and_says_what_it_chose(tmp_path, cache):
    this_machine(cache, FAST)
    result = mtjax(tmp_path, "train", *RUN, "--model.compute_dtype=auto", f"--run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr
    assert "mtjax: compute dtype bfloat16 (model.compute_dtype=auto: bf16-fast's bf16 matmul runs 1.90x" \
        in result.stderr


def test_a_bad_compute_dtype_is_refused_in_one_line(tmp_path):
    result = mtjax(tmp_path, "train", *RUN, "--model.compute_dtype=fp8", f"--run.dir={tmp_path / 'run'}")
    assert result.returncode != 0 and result.stderr.count("\n") == 1, result.stderr
    assert "model.compute_dtype must be float32, bfloat16, float16 or auto" in result.stderr
    assert not (tmp_path / "run").exists()


def test_init_of_an_auto_experiment_resolves_it_as_a_run_does(tmp_path, cache, capsys):
    """`mtjax init` makes the store a run then trains: auto there is this machine's choice,
    said in one line, and --compute-dtype given replaces it."""
    yaml = tmp_path / "exp.yaml"
    yaml.write_text("model:\n  compute_dtype: auto\n" + "".join(
        f"  {a.split('=')[0].removeprefix('--model.')}: {a.split('=')[1]}\n" for a in TINY_MODEL_ARGS))
    for profile, given, dtype in ((SLOW, [], "float32"), (FAST, [], "bfloat16"),
                                  (SLOW, ["--compute-dtype", "bfloat16"], "bfloat16")):
        this_machine(cache, profile)
        out = tmp_path / f"store-{profile.name}-{dtype}"
        assert cli.main(["init", str(yaml), str(out), *given]) == 0
        said = [line for line in capsys.readouterr().out.splitlines() if "compute dtype" in line]
        assert said == ([] if given else [f"mtjax: {compute_dtype.describe(*compute_dtype.choose(profile))}"])
        with store_lib.open(out) as store:
            assert store.config.compute_dtype == dtype
