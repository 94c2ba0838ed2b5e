"""Fault trials on real `mtjax` runs: kill -9 at random moments and rerun, damage a
committed store, and the checks of each outcome.

tests/test_faults.py and tests/test_store_one_copy.py run them with a few kills;
experiments/fault_suite.py runs many and writes docs/reliability.md's table.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import TINY_MODEL_ARGS

ROOT = Path(__file__).resolve().parents[1]
TINY = [*TINY_MODEL_ARGS,
        "--data.seq_len=32", "--data.batch_size=4", "--data.grad_accum=2", "--optim.lr=1e-2",
        "--optim.warmup_steps=0", "--optim.decay_steps=8", "--run.eval_every=0", "--run.sample_prompt=",
        "--run.log_every=1"]
# Where the state lives between steps; every run commits its store every step, and
# `--run.resume=auto` makes the same command start the run or resume it.
STATE = {
    "disk": ["--stream.engine=stream", "--store.compute=disk", "--store.master=disk", "--store.opt=disk"],
    "ram": ["--stream.engine=stream", "--store.compute=ram", "--store.master=ram", "--store.opt=ram"],
    "reference": ["--stream.engine=reference"],
    # Half the parts stay on the device with their state (updated there), half stream from disk.
    "resident": ["--stream.engine=stream", "--store.compute=disk", "--store.master=disk", "--store.opt=disk",
                 "--stream.resident=2"],
}


def train_args(run_dir: Path, steps: int, state: str = "disk") -> list[str]:
    return ["train", *TINY, *STATE[state], "--run.checkpoint_every=1", "--run.resume=auto", f"--run.steps={steps}",
            f"--run.dir={run_dir}"]


def env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}


def mtjax(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """The real entry point in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "mtjax", *args], capture_output=True, text=True, env=env(),
                          timeout=timeout, cwd=ROOT)


def run_killed(args: list[str], delay: float) -> bool:
    """Start `mtjax args`, SIGKILL it after `delay` seconds; False if it finished first."""
    p = subprocess.Popen([sys.executable, "-m", "mtjax", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env=env(), cwd=ROOT)
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
                         stderr=subprocess.DEVNULL, env=env(), cwd=ROOT)
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


# --- damage to a committed store ---------------------------------------------------------


def damaged_chunk(run: Path) -> Path:
    """The first chunk of a committed 2-D leaf in the run's store (chunk keys c.<row>.0)."""
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
