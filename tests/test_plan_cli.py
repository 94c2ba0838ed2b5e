"""`mtjax plan` as a user runs it: the placement table's marks and the exit status agree
with the plan's own byte counts, whole-run figures scale with --steps and
--price-per-hour, this machine's profile is probed once and then read from the cache,
and the drive-endurance line follows the profile."""

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mtjax import cli
from mtjax.plan import BUILTIN, fit, inputs, machine, probe, residency
from mtjax.units import size

ROOT = Path(__file__).resolve().parent.parent
SEVENTY_B = ROOT / "experiments/hf_configs/llama-3-70b.json"


@pytest.fixture
def tiny(tmp_path):
    """An eight-block Llama checkpoint directory (config only: the planner reads nothing
    else). Enough blocks that state on disk needs less RAM than in it: the disk tier's
    read buffers and writes in flight cost about three blocks' state."""
    ckpt = tmp_path / "tiny"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        **json.loads(SEVENTY_B.read_text()), "num_hidden_layers": 8, "hidden_size": 64, "intermediate_size": 128,
        "vocab_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}))
    return ckpt


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own empty profile cache, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "mtjax"


def plan_json(capsys, *args) -> tuple[int, dict, str]:
    rc = cli.main(["plan", *map(str, args), "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def profile_file(tmp_path, name, **changes) -> Path:
    return dataclasses.replace(BUILTIN["h200"], name=name, **changes).save(tmp_path / f"{name}.json")


def tight_profile(tmp_path, capsys, tiny) -> tuple[Path, float, list[dict]]:
    """A profile whose RAM holds some placements of `tiny` but not the configured all-RAM one."""
    rc, roomy, _ = plan_json(capsys, tiny, "--seq-len", 64, "--hardware", profile_file(tmp_path, "roomy"))
    assert rc == 0 and all(not p["does_not_fit"] for p in roomy["placements"])
    all_ram = next(p for p in roomy["placements"] if p["configured"])
    assert set(all_ram["placement"].values()) == {"ram"}
    least = min(p["ram_needed"] for p in roomy["placements"])
    limit = (all_ram["ram_needed"] + least) / 2  # what the run may use: RAM less the headroom
    ram = int(limit / fit.RAM_HEADROOM)
    return profile_file(tmp_path, "tight", host_ram_bytes=ram), ram * fit.RAM_HEADROOM, roomy["placements"]


def test_a_run_that_does_not_fit_is_marked_and_exits_nonzero_with_one_line(tmp_path, capsys, tiny):
    tight, limit, rows = tight_profile(tmp_path, capsys, tiny)
    command = [sys.executable, "-m", "mtjax", "plan", str(tiny), "--seq-len", "64", "--hardware", str(tight)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtjax plan: error: the configured run does not fit tight: ")
    assert "of host RAM" in err[0] and "short by" in err[0] and "store." in err[0]  # names a placement to set

    # Each row of the table is marked exactly when its own RAM figure exceeds the limit.
    table = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  compute=")}
    assert len(table) == len(rows) == 8
    for row in rows:
        name = ",".join(f"{k}={v}" for k, v in row["placement"].items())
        assert ("DOES NOT FIT: RAM" in table[name]) == (row["ram_needed"] > limit), table[name]
        assert ("configured" in table[name]) == row["configured"]
    assert any(row["ram_needed"] <= limit for row in rows)  # the test has both kinds of row

    # The same machine with a placement that fits: exit 0, nothing on stderr.
    fitting = next(r for r in rows if r["ram_needed"] <= limit)
    placement = ",".join(f"{k}={v}" for k, v in fitting["placement"].items())
    rc, doc, err = plan_json(capsys, tiny, "--seq-len", 64, "--hardware", tight, "--placement", placement)
    assert rc == 0 and err == ""
    assert [r["does_not_fit"] for r in doc["placements"]] == [["RAM"] if r["ram_needed"] > limit else []
                                                              for r in doc["placements"]]


def test_a_device_that_is_too_small_fails_the_run(tmp_path, capsys, tiny):
    # Nothing resident: the least the step needs (auto would shrink a resident set to fit).
    rc, doc, _ = plan_json(capsys, tiny, "--seq-len", 64, "--resident", "none", "--hardware",
                           profile_file(tmp_path, "roomy"))
    peak = doc["device_memory"]["peak"]
    small = profile_file(tmp_path, "small", device_memory_bytes=int(peak / fit.DEVICE_HEADROOM) - 1)
    assert cli.main(["plan", str(tiny), "--seq-len", "64", "--resident", "none", "--hardware", str(small)]) == 2
    out = capsys.readouterr()
    assert all("DOES NOT FIT: device" in line for line in out.out.splitlines() if line.startswith("  compute="))
    assert out.err.count("\n") == 1 and "of device memory" in out.err


def test_resident_auto_is_resolved_as_a_run_resolves_it_and_shown(tmp_path, capsys, tiny):
    """`mtjax plan` prices stream.resident=auto as the parts a run on that hardware keeps
    (mtjax.plan.residency), names them, and a device that holds only some keeps fewer."""
    args = (tiny, "--seq-len", 64)
    roomy = profile_file(tmp_path, "roomy")
    _, everything, _ = plan_json(capsys, *args, "--hardware", roomy)
    names = ["embed", *(f"block.{i}" for i in range(8)), "head"]
    run = inputs.load(tiny)
    run = dataclasses.replace(run, data=dataclasses.replace(run.data, seq_len=64))
    assert everything["resident"] == list(residency.for_inputs(run, BUILTIN["h200"]).resident) == names
    assert everything["stream"]["remat"] == everything["remat"] != "auto"  # resolved with it
    _, none, _ = plan_json(capsys, *args, "--hardware", roomy, "--resident", "none")
    assert none["resident"] == [] and none["times"]["step"] > everything["times"]["step"]

    # A device between the nothing-resident and the everything-resident peaks: some stay, and it fits.
    between = (none["device_memory"]["peak"] + everything["device_memory"]["peak"]) / 2
    some = profile_file(tmp_path, "some", device_memory_bytes=int(between / fit.DEVICE_HEADROOM))
    rc, doc, _ = plan_json(capsys, *args, "--hardware", some)
    assert rc == 0 and 0 < len(doc["resident"]) < len(names)
    assert doc["device_memory"]["peak"] <= between
    cli.main(["plan", *map(str, args), "--hardware", str(some)])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("resident "))
    assert ", ".join(doc["resident"]) in line and f"of {len(names)} parts" in line
    cli.main(["plan", *map(str, args), "--hardware", str(roomy)])
    assert f"resident     all of {len(names)} parts" in capsys.readouterr().out


def test_steps_and_price_scale_the_whole_run(tmp_path, capsys, tiny):
    args = (tiny, "--seq-len", 64, "--hardware", "h200", "--placement", "compute=ram,master=disk,opt=disk",
            "--resident", "none")  # state that streams from disk, so a step writes to it
    _, a, _ = plan_json(capsys, *args, "--steps", 100, "--price-per-hour", 2)
    _, b, _ = plan_json(capsys, *args, "--steps", 300, "--price-per-hour", 5)
    step = a["times"]["step"]
    assert a["run"]["wall_s"] == pytest.approx(100 * step) and b["run"]["wall_s"] == pytest.approx(300 * step)
    assert b["run"]["device_hours"] / a["run"]["device_hours"] == pytest.approx(3)
    assert a["run"]["cost"] == pytest.approx(100 * step / 3600 * 2)
    assert b["run"]["cost"] / a["run"]["cost"] == pytest.approx(3 * 5 / 2)
    assert a["traffic"]["disk_write"] > 0
    assert b["run"]["disk_write"] == 300 * a["traffic"]["disk_write"] == 300 * b["run"]["disk_write_per_step"]

    # Without --price-per-hour a built-in profile's price is used, and said to be typical.
    _, c, _ = plan_json(capsys, *args, "--steps", 100)
    assert c["run"]["cost"] == pytest.approx(100 * step / 3600 * BUILTIN["h200"].price_per_hour)
    assert "typical" in c["run"]["price_from"]
    cli.main(["plan", *map(str, args), "--steps", "100"])
    assert "typical on-demand price" in capsys.readouterr().out
    # A profile without a price: no cost, and the line says how to get one.
    unpriced = profile_file(tmp_path, "unpriced", price_per_hour=None)
    cli.main(["plan", *map(str, args), "--steps", "100", "--hardware", str(unpriced)])
    assert "pass --price-per-hour" in capsys.readouterr().out


def test_a_multi_process_run_and_its_plan_agree_on_the_residency(tmp_path, capsys, tiny, monkeypatch):
    """One function applies "a multi-process run streams every part" (residency.for_inputs):
    the settings one of two processes trains with (`for_run`, as the trainer calls it, on a
    device the profile describes) are those `mtjax plan --processes 2` prices, where one
    process keeps parts resident."""
    from mtjax import config as experiment

    exp = tmp_path / "exp.yaml"
    exp.write_text(f"model:\n  hf_config: {tiny}\ndata:\n  seq_len: 64\n  batch_size: 2\n")
    here = profile_file(tmp_path, "here")
    monkeypatch.setattr(residency, "profile_of", lambda device: BUILTIN["h200"])
    picked = ("resident", "adapters", "remat")
    for processes in (1, 2):
        run = dataclasses.asdict(residency.for_run(experiment.load(exp), processes).stream)
        rc, doc, _ = plan_json(capsys, exp, "--hardware", here, "--processes", processes)
        assert rc == 0
        assert {k: doc["stream"][k] for k in picked} == json.loads(json.dumps({k: run[k] for k in picked}))
        assert (doc["resident"] == []) == (processes == 2)
    assert doc["stream"]["adapters"] == "streamed"


def test_a_multi_process_plan_is_checked_against_one_hosts_share(tmp_path, capsys, tiny):
    """`plan --processes 2` refuses a run by what each host carries (its rows of master and
    optimizer state), as the trainer's preflight does, and names that figure; a run whose
    share fits is not refused for the whole state one host would need alone."""
    args = [tiny, "--seq-len", 64, "--batch-size", 2, "--processes", 2]
    rc, doc, _ = plan_json(capsys, *args, "--hardware", profile_file(tmp_path, "roomy"))
    alone = next(p for p in doc["placements"] if p["configured"])["ram_needed"]
    share = doc["per_host"]["ram_bytes"]
    assert rc == 0 and share < alone
    between = profile_file(tmp_path, "between", host_ram_bytes=int((share + alone) / 2 / fit.RAM_HEADROOM))
    assert cli.main(["plan", *map(str, args), "--hardware", str(between)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    small = profile_file(tmp_path, "small", host_ram_bytes=int(share * 0.8 / fit.RAM_HEADROOM))
    assert cli.main(["plan", *map(str, args), "--hardware", str(small)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtjax plan: error: the configured run does not fit each host of 2 "
                                               f"(small): needs {size(share)} of host RAM"), err


def test_steps_default_to_the_configs_run_steps(tmp_path, capsys):
    exp = tmp_path / "exp.yaml"
    exp.write_text("data:\n  seq_len: 64\nrun:\n  steps: 37\n")
    rc, doc, _ = plan_json(capsys, exp, "--hardware", "h200")
    assert rc == 0 and doc["run"]["steps"] == 37 and doc["run"]["wall_s"] == pytest.approx(37 * doc["times"]["step"])


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--price-per-hour", "nan"], ["--price-per-hour", "-1"],
                                 ["--reprobe", "--hardware", "h200"]])
def test_bad_run_figures_are_one_line(tiny, capsys, bad):
    try:
        rc = cli.main(["plan", str(tiny), *bad])
    except SystemExit as e:  # the parser refuses a flag out of its range (mtjax.bounds.flag), as argparse exits
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mtjax plan: error: ")


def test_drive_endurance_line_follows_the_profile(tmp_path, capsys, tiny):
    args = ["plan", str(tiny), "--seq-len", "64", "--placement", "compute=ram,master=disk,opt=disk", "--steps", "1000"]
    _, doc, _ = plan_json(capsys, *args[1:], "--hardware", "h200")
    used = 1000 * doc["traffic"]["disk_write"] / BUILTIN["h200"].drive_endurance_bytes
    assert doc["run"]["endurance_used"] == pytest.approx(used)
    assert cli.main([*args, "--hardware", "h200"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if "drive endurance" in ln]
    assert len(line) == 1 and f"{used:.1%}" in line[0] and "typical" in line[0]
    assert cli.main([*args, "--hardware", "cpu-2core"]) == 0  # no drive figure in that profile
    assert "drive endurance" not in capsys.readouterr().out


@pytest.mark.slow  # probes this machine, ~18 s
def test_this_machine_is_probed_once_then_read_from_the_cache(tiny, capsys, cache, monkeypatch):
    measured = []
    real = probe.run

    def counting(*args, **kwargs):  # the real quick probe, measured once and counted every call
        if not measured:
            measured.append(real(*args, **kwargs))
        calls.append(kwargs)
        return measured[0]

    calls = []
    monkeypatch.setattr(probe, "run", counting)
    assert cli.main(["plan", str(tiny), "--seq-len", "64"]) == 0
    first = capsys.readouterr().out
    cached = cache / f"hardware-{machine.key()}.json"
    assert len(calls) == 1 and calls[0]["quick"] and cached.exists()
    assert f"probed now (quick probe: rough figures), cached at {cached}" in first

    assert cli.main(["plan", str(tiny), "--seq-len", "64"]) == 0
    second = capsys.readouterr().out
    assert len(calls) == 1  # no second probe
    assert "probed 20" in second and f"cached at {cached}" in second
    assert [ln for ln in first.splitlines() if ln.startswith("hardware")] == \
           [ln for ln in second.splitlines() if ln.startswith("hardware")]

    assert cli.main(["plan", str(tiny), "--seq-len", "64", "--reprobe"]) == 0
    assert len(calls) == 2 and "probed now" in capsys.readouterr().out


def test_an_injected_profile_in_the_cache_is_used_without_probing(tiny, capsys, cache, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("probed although a cached profile exists")

    monkeypatch.setattr(probe, "run", refuse)
    dataclasses.replace(BUILTIN["cpu-2core"], name="injected").save(cache / f"hardware-{machine.key()}.json")
    rc, doc, _ = plan_json(capsys, tiny, "--seq-len", "64")
    assert rc == 0 and doc["hardware"] == "injected" and "this machine" in doc["profile"]


def test_help_lists_the_profiles_and_the_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in BUILTIN)
    assert "Default: this machine" in text and "Predict" in text  # the description paragraph


def test_planner_modules_import_nothing_of_mtjax_inside_functions():
    """No import cycle held together by function-level imports (cost.py excepted: its
    rewrite to the engine's schedule removes them)."""
    for path in sorted((ROOT / "mtjax/plan").glob("*.py")) + [ROOT / "mtjax/commands/plan.py"]:
        if path.name == "cost.py":
            continue
        tree = ast.parse(path.read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mtjax"):
                    pytest.fail(f"{path.name}:{node.lineno} imports {node.module} inside {fn.name}")
                if isinstance(node, ast.Import) and any(a.name.startswith("mtjax") for a in node.names):
                    pytest.fail(f"{path.name}:{node.lineno} imports mtjax inside {fn.name}")


@pytest.mark.parametrize("seq", ["8193", "1000000000"])
def test_a_sequence_past_the_models_context_is_refused_in_one_line(capsys, seq):
    assert cli.main(["plan", str(SEVENTY_B), "--hardware", "h200", "--seq-len", seq]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == (
        f"mtjax plan: error: --seq-len ({seq}) exceeds the model's context (model.max_position_embeddings = 8192): "
        "lower --seq-len, or extend the context in an experiment YAML (model.max_position_embeddings, with "
        "model.rope_scaling such as {rope_type: yarn, factor: 4})\n")


def test_an_experiment_past_its_context_is_refused_and_one_that_extends_it_plans(tmp_path, capsys, tiny):
    exp = tmp_path / "exp.yaml"
    exp.write_text(f"model:\n  hf_config: {tiny}\ndata:\n  seq_len: 16384\n")
    assert cli.main(["plan", str(exp), "--hardware", "h200"]) == 2
    assert f"data.seq_len of {exp} (16384) exceeds the model's context" in capsys.readouterr().err
    exp.write_text(f"model:\n  hf_config: {tiny}\n  max_position_embeddings: 16384\n  rope_scaling: "
                   "{rope_type: yarn, factor: 2, original_max_position_embeddings: 8192}\ndata:\n  seq_len: 16384\n")
    rc, doc, err = plan_json(capsys, exp, "--hardware", "h200", "--resident", "none")
    assert rc == 0 and err == "" and doc["shape"]["seq"] == 16384 and doc["device_memory"]["residuals"] > 0


def test_a_bare_config_plans_at_most_its_context(tmp_path, capsys, tiny):
    short = json.loads((tiny / "config.json").read_text())
    (tiny / "config.json").write_text(json.dumps({**short, "max_position_embeddings": 512}))
    rc, doc, _ = plan_json(capsys, tiny, "--hardware", "h200")
    assert rc == 0 and doc["shape"]["seq"] == 512


def test_a_json_file_that_sets_a_key_twice_is_refused_naming_it_and_both_lines(tmp_path, capsys, tiny):
    """json.loads would keep the later value silently: a hand-edited config.json or
    hardware profile that says one thing twice is refused instead."""
    text = (tiny / "config.json").read_text()
    (tiny / "config.json").write_text(text.replace('{', '{\n"num_hidden_layers": 2,\n', 1))
    assert cli.main(["plan", str(tiny), "--hardware", "h200"]) == 2
    assert capsys.readouterr().err == (f"mtjax plan: error: {tiny / 'config.json'} sets num_hidden_layers twice "
                                       "(lines 2 and 3); keep one of them\n")
    profile = profile_file(tmp_path, "twice")
    profile.write_text(profile.read_text().replace('  "devices": 1,\n', '  "devices": 1,\n  "devices": 8,\n'))
    line = 1 + next(i for i, x in enumerate(profile.read_text().splitlines()) if '"devices"' in x)
    (tiny / "config.json").write_text(text)
    assert cli.main(["plan", str(tiny), "--hardware", str(profile)]) == 2
    assert capsys.readouterr().err == (f"mtjax plan: error: {profile} sets devices twice (lines {line} and "
                                       f"{line + 1}); keep one of them\n")


def test_a_plan_of_days_a_step_keeps_its_tables_columns_apart(tmp_path, capsys):
    """A slow machine's figures (a step of days, PFLOPs of work, under one token a second)
    in units that fit their columns: every row of the stage and placement tables splits
    into its columns, a time is in days, and the throughput is not rounded to zero."""
    slow = profile_file(tmp_path, "slow", matmul_flops_fp32=1e9, matmul_flops_bf16=1e9)
    rc = cli.main(["plan", str(SEVENTY_B), "--hardware", str(slow)])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    figure = r"[\d.,]+ [A-Za-z/]+"  # a number and its unit
    stages = lines[lines.index(next(line for line in lines if line.startswith("stage"))) + 1:][:5]
    for line in stages:
        assert re.fullmatch(rf"  [\w>+ -]+?  +({figure}) +({figure}) +({figure}|-)", line), line
    assert "PF" in stages[0] and " days" in stages[0]
    rows = [line for line in lines if line.startswith("  compute=")]
    assert len(rows) == 8
    for line in rows:
        assert re.fullmatch(rf"  compute=\w+,master=\w+,opt=\w+ +({figure}) +({figure}) +({figure})(   .*)?", line), line
    (throughput,) = [line for line in lines if line.startswith("throughput")]
    assert float(throughput.split()[1]) > 0, throughput
