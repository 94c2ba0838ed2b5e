"""Fault suite: inject faults into real `mtjax` runs and check each outcome.

    .venv/bin/python experiments/fault_suite.py [--kills 50] [--out docs/reliability.md]
    .venv/bin/python experiments/fault_suite.py --quick --out /tmp/faults.md   # the kill -9 trials, 4 each

Faults: kill -9 of `mtjax train` (a store commit every step; all state on disk, all
state in RAM, resident parts, and the reference engine) at random moments, then the same command again
until it finishes, whose final weights must equal an uninterrupted run's bit for bit; kill -9 of `mtjax import`
and `mtjax export`, rerun, output equal to a clean one; damaged stores (a flipped byte,
a truncated chunk, a deleted chunk, another store's manifest) refused with an error
naming the damage. The trials live in tests/fault_trials.py, which tests/test_faults.py
runs with fewer kills in CI. Writes the results table to docs/reliability.md (between
its suite markers).
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fault_trials import damage_trials, env, kill_import_export_trials, kill_train_trials  # noqa: E402


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
    ap.add_argument("--resident-kills", type=int, default=20,
                    help="kill -9 trials of mtjax train with resident parts (two copies, then as many on one copy)")
    ap.add_argument("--quick", action="store_true",
                    help="the kill -9 trials of mtjax train only, 4 of each kind (damage, import/export and the "
                         "in-process tests are left out)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default="/dev/shm/mtjax-fault-suite" if Path("/dev/shm").is_dir() else "/tmp/mtjax-fault-suite")
    ap.add_argument("--out", default=str(ROOT / "docs" / "reliability.md"))
    a = ap.parse_args()
    if a.quick:
        a.kills = a.one_copy_kills = a.ram_kills = a.reference_kills = a.resident_kills = 4
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
    for copies in ((), ("--store.copies=1",)) if a.resident_kills else ():
        k = kill_train_trials(work / f"resident{len(copies)}", a.resident_kills, a.steps, rng, extra=copies,
                              state="resident")
        store = "a one-copy store, each step committing the resident state" if copies else "a two-copy store"
        rows.append((f"kill -9 of `mtjax train` with resident parts (`--stream.resident=2`, the rest streamed from "
                     f"disk; {store}), rerun until done",
                     f"{k['kills']} kills ({k['before_store']} before the first commit, {k['mid_store']} after), "
                     f"{k['launches']} launches",
                     "final weights bit-identical to an uninterrupted two-copy run" if k["ok"] else f"FAILED {k['error']}"))
        print(rows[-1], f"{time.time() - t:.0f} s", flush=True)
    if a.quick:
        write_table(Path(a.out), rows, "python experiments/fault_suite.py " + " ".join(sys.argv[1:]))
        print(f"wrote {a.out} in {time.time() - t:.0f} s")
        return
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
        ("a step whose every target is masked, both engines",
         "tests/test_documents.py::test_a_step_with_no_counted_target_is_one_clear_error",
         "NothingToTrain, one line, before anything runs; no step taken"),
        ("full disk during a step (8 MiB tmpfs)", faults + "test_full_disk_during_a_step_fails_cleanly_and_resumes",
         "one clear error; last commit intact; after freeing space the same command ends bit-identical"),
        ("prefetch worker raises", stream + "test_worker_error_reaches_the_caller_and_the_next_step_runs",
         "raised by the same step, no hang; the next steps equal the reference"),
        ("write-back worker raises", faults + "test_failing_write_back_surfaces_in_the_next_step",
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
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", test], capture_output=True, text=True, env=env(),
                           cwd=ROOT)
        out.append((name, f"{outcome} (`{test.split('::')[1]}`)" if r.returncode == 0 else f"FAILED: {test}"))
    return out


if __name__ == "__main__":
    main()
