"""Fault suite: inject faults into real `mtjax` runs and check each outcome.

    .venv/bin/python experiments/fault_suite.py [--kills 50] [--out docs/reliability.md]

Faults: kill -9 of `mtjax train` (a store commit every step; all state on disk, all
state in RAM, and the reference engine) at random moments, then the same command again
until it finishes, whose final weights must equal an uninterrupted run's bit for bit; kill -9 of `mtjax import`
and `mtjax export`, rerun, output equal to a clean one; damaged stores (a flipped byte,
a truncated chunk, a deleted chunk, another store's manifest) refused with an error
naming the damage. tests/test_faults.py runs the same trials with fewer kills in CI.
Writes the results table to docs/reliability.md (between its suite markers).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model.hidden_size=32", "--model.intermediate_size=64", "--model.num_hidden_layers=2",
        "--model.num_attention_heads=2", "--model.num_key_value_heads=1", "--model.head_dim=16",
        "--data.seq_len=32", "--data.batch_size=4", "--data.grad_accum=2", "--optim.lr=1e-2",
        "--optim.warmup_steps=0", "--optim.decay_steps=8", "--run.eval_every=0", "--run.sample_prompt=",
        "--run.log_every=1"]
# Where the state lives between steps; every run commits its store every step, and
# `--run.resume=auto` makes the same command start the run or resume it.
STATE = {
    "disk": ["--stream.engine=stream", "--store.compute=disk", "--store.master=disk", "--store.opt=disk"],
    "ram": ["--stream.engine=stream", "--store.compute=ram", "--store.master=ram", "--store.opt=ram"],
    "reference": ["--stream.engine=reference"],
}


def train_args(run_dir: Path, steps: int, state: str = "disk") -> list[str]:
    return ["train", *TINY, *STATE[state], "--run.checkpoint_every=1", "--run.resume=auto", f"--run.steps={steps}",
            f"--run.dir={run_dir}"]


def _env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}


def mtjax(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """The real entry point in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "mtjax", *args], capture_output=True, text=True, env=_env(),
                          timeout=timeout, cwd=ROOT)


def run_killed(args: list[str], delay: float) -> bool:
    """Start `mtjax args`, SIGKILL it after `delay` seconds; False if it finished first."""
    p = subprocess.Popen([sys.executable, "-m", "mtjax", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=_env(), cwd=ROOT)
    try:
        p.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        return True


def run_killed_after_commit(args: list[str], run_dir: Path, step: int, delay: float) -> bool:
    """Start `mtjax args`, SIGKILL it `delay` seconds after its store commits `step` (so the
    kill lands in the next step, its commit or the final export); False if it finished first."""
    p = subprocess.Popen([sys.executable, "-m", "mtjax", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=_env(), cwd=ROOT)
    while p.poll() is None:
        now = store_step(run_dir)
        if now is not None and now >= step:
            time.sleep(delay)
            break
        time.sleep(0.02)
    if p.poll() is not None:
        return False
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    return True


def store_step(run_dir: Path) -> int | None:
    import json

    m = run_dir / "store" / "manifest.json"
    try:
        return json.loads(m.read_text())["step"]
    except (OSError, ValueError):
        return None


def same_files(a: Path, b: Path, names: list[str]) -> bool:
    return all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def kill_train_trials(work: Path, kills: int, steps: int, rng: random.Random, window=(0.1, 1.0),
                      extra: tuple[str, ...] = (), state: str = "disk") -> dict:
    """One scripted run (`state`: a key of STATE) killed `kills` times, rerun after each
    kill; its final weights against an uninterrupted run's (without `extra`, e.g. a
    one-copy store against the default two copies). Half the kills come at a random
    moment (`window`, a share of the clean run's duration), half just after a random
    store commit."""
    clean = work / "clean"
    t = time.perf_counter()
    r = mtjax(train_args(clean, steps, state))
    assert r.returncode == 0, r.stderr
    seconds = time.perf_counter() - t  # kill times scale with how fast this machine runs
    run = work / "killed"
    args = train_args(run, steps, state) + list(extra)
    done, at_steps, reruns = 0, [], 0
    while done < kills:
        before = store_step(run)
        if done % 2:  # right after a commit: inside the next step, its commit or the export
            killed = run_killed_after_commit(args, run, rng.randrange(steps + 1), rng.uniform(0.0, 0.5))
        else:  # anywhere, from interpreter start-up to the end
            killed = run_killed(args, seconds * rng.uniform(*window))
        if killed:
            done += 1
            at_steps.append((before, store_step(run)))
        else:  # the run finished before the kill: start over, so every kill lands mid-run
            shutil.rmtree(run)
        reruns += 1
    r = mtjax(args)  # the resume that finishes the run
    ok = r.returncode == 0 and same_files(clean / "final", run / "final", ["model.safetensors"])
    return {"kills": done, "ok": ok, "launches": reruns + 1, "error": r.stderr.strip().splitlines()[-1:] if not ok else [],
            "mid_store": sum(1 for b, a in at_steps if a is not None), "before_store": sum(1 for b, a in at_steps if a is None)}


def kill_import_export_trials(work: Path, kills: int, rng: random.Random) -> dict:
    """`mtjax import` and `mtjax export` killed at random moments, then rerun: the rerun's
    output equals a clean one."""
    base = work / "ie"
    r = mtjax(train_args(base / "src", 1))
    assert r.returncode == 0, r.stderr
    ckpt = base / "src" / "final"
    seconds = {}
    for cmd, args in [("import", ["import", str(ckpt), str(base / "clean_store"), "--compute-dtype=float32"]),
                      ("export", ["export", str(base / "clean_store"), str(base / "clean_out")])]:
        t = time.perf_counter()
        assert mtjax(args).returncode == 0
        seconds[cmd] = time.perf_counter() - t  # kills land within a clean run's duration
    results = {"import": [0, 0, 0], "export": [0, 0, 0]}  # [kills landed, outputs equal, finished before the kill]
    for i in range(kills):
        cmd = "import" if i % 2 == 0 else "export"
        store, out = base / f"store{i}", base / f"out{i}"
        args = (["import", str(ckpt), str(store), "--compute-dtype=float32"] if cmd == "import"
                else ["export", str(base / "clean_store"), str(out)])
        target = store if cmd == "import" else out
        if run_killed(args, seconds[cmd] * rng.uniform(0.3, 1.0)):
            results[cmd][0] += 1
            # Output is renamed into place whole: if it exists the killed command had
            # finished (checked below); otherwise the same command is run again.
            finished = target.exists()
            results[cmd][2] += finished
            ok = finished or mtjax(args).returncode == 0
            if cmd == "import":
                ok = ok and mtjax(["export", str(store), str(out)]).returncode == 0
            ok = ok and same_files(base / "clean_out", out, ["model.safetensors", "config.json"])
            results[cmd][1] += ok
    return results


# --- damage to a committed store (tests/test_faults.py uses these too) ---------------------


def damaged_chunk(run: Path) -> Path:
    """The first chunk of a committed 2-D leaf in the run's store (chunk keys c.<row>.0)."""
    import json

    slots = json.loads((run / "store" / "manifest.json").read_text())["slots"]
    d = run / "store" / "parts" / "block.1" / f"master.{slots['block.1']['master']}"
    return d / "mlp.down_proj.kernel" / "c.0.0"


def flip_byte(run: Path) -> None:
    c = damaged_chunk(run)
    b = bytearray(c.read_bytes())
    b[len(b) // 2] ^= 0x01
    c.write_bytes(bytes(b))


def truncate_chunk(run: Path) -> None:
    c = damaged_chunk(run)
    c.write_bytes(c.read_bytes()[: c.stat().st_size // 2])


def delete_chunk(run: Path) -> None:
    damaged_chunk(run).unlink()


def damage_trials(work: Path) -> dict[str, tuple[bool, str]]:
    """Each kind of damage to a committed store: the resumed run exits 2 with one line
    naming it; the store is not changed by the attempt."""
    src = work / "damage_src"
    assert mtjax(train_args(src, 2)).returncode == 0
    other = work / "damage_other"
    assert mtjax(train_args(other, 3)).returncode == 0
    out = {}

    def foreign(run):
        shutil.copy(other / "store" / "manifest.json", run / "store" / "manifest.json")

    for name, damage, expect in [("flipped byte in a stored array", flip_byte, "block.1 master"),
                                 ("truncated chunk", truncate_chunk, "block.1 master"),
                                 ("deleted chunk", delete_chunk, "block.1 master"),
                                 ("manifest from another run", foreign, "another store")]:
        run = work / f"damaged-{name.split()[0]}"
        shutil.copytree(src, run)
        damage(run)
        snapshot = committed_files(run / "store")
        r = mtjax(train_args(run, 4))
        errors = [line for line in r.stderr.splitlines() if "error" in line]
        ok = (r.returncode == 2 and len(errors) == 1 and expect in errors[0] and "Traceback" not in r.stderr
              and committed_files(run / "store") == snapshot)
        out[name] = (ok, errors[-1] if errors else r.stderr.strip()[-300:])
    return out


def committed_files(store: Path) -> dict:
    """Bytes of every file the committed step consists of (not the uncommitted slots,
    which a run writes before it reaches the damage)."""
    import json

    m = json.loads((store / "manifest.json").read_text())
    dirs = [store / "train_state"] + [store / "parts" / p / f"{k}.{s}" for p, kinds in m["slots"].items()
                                      for k, s in kinds.items() if s]
    files = [store / "manifest.json", store / "schema.json"] + [f for d in dirs for f in d.rglob("*") if f.is_file()]
    return {f: f.read_bytes() for f in files}


def write_table(path: Path, rows: list[tuple[str, str, str]], command: str) -> None:
    start, end = "<!-- fault-suite:start -->", "<!-- fault-suite:end -->"
    table = [start, f"Produced by `{command}` on {time.strftime('%Y-%m-%d')}.", "",
             "| fault | trials | outcome |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows), end]
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        text = text[: text.index(start)] + "\n".join(table) + text[text.index(end) + len(end):]
    else:
        text += "\n".join(table) + "\n"
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=50, help="kill -9 trials of mtjax train")
    ap.add_argument("--ie-kills", type=int, default=10, help="kill -9 trials of mtjax import / export")
    ap.add_argument("--one-copy-kills", type=int, default=30, help="kill -9 trials of mtjax train on a one-copy store")
    ap.add_argument("--ram-kills", type=int, default=30, help="kill -9 trials of mtjax train with all state in RAM")
    ap.add_argument("--reference-kills", type=int, default=10, help="kill -9 trials of mtjax train, reference engine")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="/dev/shm/mtjax-fault-suite" if Path("/dev/shm").is_dir() else "/tmp/mtjax-fault-suite")
    ap.add_argument("--out", default=str(ROOT / "docs" / "reliability.md"))
    a = ap.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rng = random.Random(a.seed)
    rows = []
    t = time.time()
    k = kill_train_trials(work, a.kills, a.steps, rng)
    rows.append(("kill -9 of `mtjax train` (stream engine, state on disk, commit every step), rerun until done",
                 f"{k['kills']} kills ({k['before_store']} before the first commit, {k['mid_store']} after), "
                 f"{k['launches']} launches",
                 "final weights bit-identical to an uninterrupted run" if k["ok"] else f"FAILED {k['error']}"))
    print(rows[-1], f"{time.time() - t:.0f} s", flush=True)
    if a.one_copy_kills:
        k = kill_train_trials(work / "one-copy", a.one_copy_kills, a.steps, rng, extra=("--store.copies=1",))
        rows.append(("kill -9 of `mtjax train` on a one-copy store (`--store.copies=1`), rerun until done",
                     f"{k['kills']} kills ({k['before_store']} before the first commit, {k['mid_store']} after), "
                     f"{k['launches']} launches",
                     "final weights bit-identical to an uninterrupted two-copy run" if k["ok"] else f"FAILED {k['error']}"))
        print(rows[-1], f"{time.time() - t:.0f} s", flush=True)
    for state, kills, what in [("ram", a.ram_kills, "stream engine, all state in RAM"),
                               ("reference", a.reference_kills, "reference engine")]:
        if kills:
            k = kill_train_trials(work / state, kills, a.steps, rng, state=state)
            rows.append((f"kill -9 of `mtjax train` ({what}, commit every step), rerun until done",
                         f"{k['kills']} kills ({k['before_store']} before the first commit, {k['mid_store']} after), "
                         f"{k['launches']} launches",
                         "final weights bit-identical to an uninterrupted run" if k["ok"] else f"FAILED {k['error']}"))
            print(rows[-1], f"{time.time() - t:.0f} s", flush=True)
    ie = kill_import_export_trials(work, a.ie_kills, rng)
    for cmd, (landed, equal, finished) in ie.items():
        rows.append((f"kill -9 of `mtjax {cmd}`, rerun", f"{landed} kills ({finished} after the output was in place)",
                     f"{equal}/{landed} outputs bit-identical to a clean {cmd}; never a partial output"))
    print(rows[-2:], flush=True)
    for name, (ok, line) in damage_trials(work).items():
        rows.append((name, "1", ("refused before use, committed state unchanged: " if ok else "FAILED: ")
                     + f"`{line.replace(str(work), '…')}`"))
        print(rows[-1], flush=True)
    for name, outcome in test_results():
        rows.append((name, "1 (pytest)", outcome))
    write_table(Path(a.out), rows, "python experiments/fault_suite.py " + " ".join(sys.argv[1:]))
    print(f"wrote {a.out} in {time.time() - t:.0f} s")


def test_results() -> list[tuple[str, str]]:
    """Faults checked in-process by tests/test_faults.py; listed with the outcome the tests assert."""
    faults, stream = "tests/test_faults.py::", "tests/test_stream.py::"
    cases = [
        ("NaN/Inf gradients of block.1, both engines", faults + "test_nonfinite_step_changes_no_state_and_names_the_block",
         "NonFiniteStep naming block.1; no state changed (the next step equals a run without the bad batch)"),
        ("NaN/Inf in a run, run.on_nonfinite=stop and skip", faults + "test_run_on_nonfinite",
         "stop: one line naming block.1, last commit intact; skip: step recorded as skipped, run finishes"),
        ("full disk during a step (8 MiB tmpfs)", faults + "test_full_disk_during_a_step_fails_cleanly_and_resumes",
         "one clear error; last commit intact; after freeing space the same command ends bit-identical"),
        ("prefetch worker raises", stream + "test_worker_error_reaches_the_caller_and_the_next_step_runs",
         "raised by the same step, no hang; the next steps equal the reference"),
        ("write-back worker raises", faults + "test_failing_write_back_surfaces_within_the_step",
         "raised by the same step, no hang"),
        ("second trainer on the same store", faults + "test_second_trainer_on_the_same_store_is_refused",
         "refused: the store is already open for writing"),
        ("host RAM / disk / data short (preflight)", faults + "test_preflight_names_what_is_short",
         "refused before step 1, naming the shortfall"),
        ("model beyond host RAM via `mtjax train`", faults + "test_train_refuses_a_model_beyond_host_ram_before_making_it",
         "one line before any weight is made"),
        ("bad input via `mtjax train` (10 kinds)", faults + "test_bad_input_to_train_is_one_line",
         "one line each, exit 2, no traceback"),
    ]
    out = []
    for name, test, outcome in cases:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", test], capture_output=True, text=True, env=_env(),
                           cwd=ROOT)
        out.append((name, f"{outcome} (`{test.split('::')[1]}`)" if r.returncode == 0 else f"FAILED: {test}"))
    return out


if __name__ == "__main__":
    main()
