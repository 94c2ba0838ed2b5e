"""Whole kinds of input that end in one line, not a traceback (docs/reliability.md, the
bad-input table): text in other encodings, an environment that asks for what is not
there, a full or read-only disk under a library's writer, and Ctrl-C during start-up.

The encodings and the writers run in this process (`cli.main(argv)` and the writers
themselves); the environment and Ctrl-C need a fresh `python -m mtjax` each.
"""

from __future__ import annotations

import codecs
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import small_disk
from mtjax import cli, textfile, writable
from mtjax.data import tokenizer as toklib
from test_bad_input import QWEN_TOKENIZER, TINY, snapshot

CONFIG = "run:\n  steps: 3  # café\n"


def one_line(capsys, argv: list[str], expect: str) -> str:
    """Run `mtjax argv` here; it must fail with exactly one line holding `expect`."""
    assert cli.main(argv) == 2, argv
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0] and "Traceback" not in captured.err, (argv, captured.err)
    return lines[0]


# -- text from outside, in any encoding ---------------------------------------------------------

def test_text_with_a_byte_order_mark_reads_as_its_utf8(tmp_path):
    """The documented choice (mtjax.textfile): UTF-8 with or without a BOM, UTF-16 and
    UTF-32 with one, all give the same text."""
    for encoding in ("utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32"):
        raw = CONFIG.encode(encoding)
        if encoding in ("utf-16-le", "utf-16-be"):  # these codecs write no BOM: add the one a Windows editor does
            raw = (codecs.BOM_UTF16_LE if encoding.endswith("le") else codecs.BOM_UTF16_BE) + raw
        (tmp_path / "c.yaml").write_bytes(raw)
        assert textfile.read(tmp_path / "c.yaml") == CONFIG, encoding


def test_text_in_another_encoding_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("latin1.yaml").write_bytes(CONFIG.encode("latin-1"))
    Path("cut.yaml").write_bytes(CONFIG.encode()[:-2])  # the file ends inside "é"
    Path("utf16.yaml").write_bytes(CONFIG.encode("utf-16"))
    run = Path("run")
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(json.dumps({"step": 1, "loss": 2.0}).encode() + b"\n"
                                        + '{"step": 2, "loss": 1.0, "note": "é"}\n'.encode("latin-1"))
    ckpt = Path("ckpt")
    ckpt.mkdir()
    (ckpt / "config.json").write_bytes('{"model_type": "llama", "note": "é"}'.encode("latin-1"))
    tok = Path("tok")
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes(b'{"model": {"type": "BPE"}, "x": "\xe9"}')
    cfg = Path("tokcfg")
    cfg.mkdir()
    (cfg / "tokenizer.json").write_bytes(Path(QWEN_TOKENIZER).read_bytes())
    (cfg / "tokenizer_config.json").write_bytes('{"eos_token": "é"}'.encode("latin-1"))
    Path("text.txt").write_bytes("café au lait\n".encode("latin-1"))
    Path("chat.jsonl").write_bytes((json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                             {"role": "assistant", "content": "yo"}]}) + "\n")
                                   .encode("utf-16"))
    before = snapshot(tmp_path)
    one_line(capsys, ["train", "latin1.yaml", *TINY], "latin1.yaml is not UTF-8 text (byte 0xe9 at offset 22); "
                                                      "save it as UTF-8")
    one_line(capsys, ["train", "cut.yaml", *TINY], "cut.yaml is not UTF-8 text (it ends inside a character")
    one_line(capsys, ["plot", "run", "--out", "c.png"], "metrics.jsonl is not UTF-8 text (byte 0xe9")
    one_line(capsys, ["generate", "ckpt", "--tokenizer", "bytes"], "config.json is not UTF-8 text")
    one_line(capsys, ["data", "prepare", "text.txt", "--out", "d", "--tokenizer", "tok"],
             "tokenizer.json is not a Hugging Face tokenizer.json")
    one_line(capsys, ["data", "prepare", "text.txt", "--out", "d", "--tokenizer", "tokcfg"],
             "tokenizer_config.json is not UTF-8 text")
    one_line(capsys, ["data", "prepare", "text.txt", "--out", "d"], "text.txt is not UTF-8 text")
    one_line(capsys, ["data", "prepare", "chat.jsonl", "--out", "d", "--format", "chat", "--seq-len", "64",
                      "--tokenizer", str(Path(QWEN_TOKENIZER).parent)], "chat.jsonl is not UTF-8 text")
    # A prompt given in another encoding reaches Python as lone surrogates (surrogateescape).
    prompt = b"caf\xe9 au lait".decode("utf-8", "surrogateescape")
    one_line(capsys, ["generate", "ckpt", "--prompt", prompt], "--prompt is not UTF-8 text (byte 0xe9 at offset 3)")
    assert snapshot(tmp_path) == before
    # The UTF-16 file is the same config as its UTF-8 text.
    assert cli.main(["train", "utf16.yaml", "--print-config"]) == 0
    assert "steps: 3" in capsys.readouterr().out


def test_a_unicode_error_met_anywhere_is_one_line():
    """The command line's last resort, for a decode without a file name."""
    try:
        b"ab\xff".decode()
    except UnicodeDecodeError as e:
        assert cli._one_line(e) == "some input is not UTF-8 text (byte 0xff at offset 2); save it as UTF-8"
    try:
        "a\udce9".encode()
    except UnicodeEncodeError as e:
        assert "some text holds bytes that are not UTF-8" in cli._one_line(e)


# -- a full or read-only disk under each writer --------------------------------------------------

@pytest.fixture(params=["full", "read-only"])
def bad_disk(request, tmp_path):
    """A directory on a full disk, or on a read-only one."""
    if request.param == "full":
        with small_disk.mounted(tmp_path / "full", "1m") as mnt:
            (mnt / "d").mkdir()
            small_disk.fill(mnt)
            yield mnt / "d", "No space left on device; free space"
            (mnt / "ballast").unlink()
    else:
        with small_disk.read_only(tmp_path / "ro") as ro:
            yield ro, "choose a directory you may write to" if os.geteuid() else "Read-only file system"


@pytest.mark.slow  # mounts a tmpfs and makes a model's weights
def test_third_party_writers_name_the_path(bad_disk):
    """tokenizers, TensorBoard (tensorboardX), safetensors and mtjax's own files: the error
    is one line naming the file and what to do (tokenizers words it as a bare Exception)."""
    where, expect = bad_disk
    tok = toklib.load(QWEN_TOKENIZER)
    with pytest.raises(OSError) as e:
        tok.save(where)
    assert cli._one_line(e.value).startswith(f"{where / toklib.TOKENIZER_FILE}: ") and expect in cli._one_line(e.value)

    from mtjax.progress import Progress

    def progress():
        with Progress(where, 2, 10, tensorboard=True, stream=open(os.devnull, "w")) as p:
            for step in (1, 2):
                p.update(step, {"loss": 2.0, "lr": 1e-3})

    with pytest.raises(OSError) as e:  # before, a full disk left tensorboardX's close() waiting forever
        progress()
    assert str(where) in cli._one_line(e.value) and expect in cli._one_line(e.value)

    from test_generate import CFG

    from mtjax import hf, model

    with pytest.raises(Exception) as e:  # safetensors words a full disk as its own SafetensorError
        hf.save_params(CFG, model.init_params(CFG, seed=0), where / "x")
    assert str(where / "x") in cli._one_line(e.value)


def test_a_library_error_carrying_an_os_error_becomes_one(tmp_path):
    """tokenizers and safetensors put the OS error in their text, as Rust prints it."""
    with pytest.raises(OSError) as e, writable.writing(tmp_path / "x.json"):
        raise Exception("Read-only file system (os error 30)")
    assert cli._one_line(e.value) == f"{tmp_path / 'x.json'}: Read-only file system; choose a location on a " \
                                     "writable disk"
    with pytest.raises(ValueError), writable.writing(tmp_path / "x.json"):
        raise ValueError("not about the disk")  # anything else goes on as it was


def test_a_run_file_on_a_bad_disk_is_whole_or_absent(bad_disk):
    """config.yaml and summary.json (mtjax.writable.write_text): one line naming the file,
    and neither it nor its temporary file left behind."""
    where, expect = bad_disk
    with pytest.raises(OSError) as e:
        writable.write_text(where / "summary.json", "x" * (256 << 10))
    assert cli._one_line(e.value).startswith(f"{where / 'summary.json'}: ") and expect in cli._one_line(e.value)
    assert not [p for p in where.iterdir() if p.name != "ballast"]


def test_plot_on_a_bad_disk_leaves_no_partial_image(bad_disk, tmp_path, capsys):
    where, _ = bad_disk
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 3.0 / i}) + "\n" for i in range(1, 50)))
    one_line(capsys, ["plot", str(run), "--out", str(where / "c.png")], f"cannot write {where / 'c.png'}")
    assert not [p for p in where.iterdir() if p.name != "ballast"]


# -- the environment ------------------------------------------------------------------------------

def start(cwd: Path, args: list[str], env: dict, code: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TMPDIR": str(cwd), **env}
    for name in [k for k, v in env.items() if v is None]:
        del env[name]
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "mtjax", *args]
    return subprocess.Popen(command, cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def check_one_line(p: subprocess.Popen, what, expect: str, rc: int = 2) -> None:
    out, err = p.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert p.returncode == rc and "Traceback" not in err + out, (what, p.returncode, err[-3000:])
    assert len(lines) == 1 and expect in lines[0], (what, err[-3000:])


@pytest.mark.slow  # a dozen interpreter start-ups
def test_an_environment_that_asks_for_what_is_not_there(tmp_path):
    train = ["train", *TINY, "--run.steps=1"]
    count = "--xla_force_host_platform_device_count"
    cases = [
        ({"JAX_PLATFORMS": "cuda"}, "JAX could not start the platform JAX_PLATFORMS='cuda' asks for"),
        ({"JAX_PLATFORMS": "tpu"}, "JAX could not start the platform JAX_PLATFORMS='tpu' asks for"),
        ({"JAX_PLATFORMS": "cuda", "CUDA_VISIBLE_DEVICES": "-1"}, "(or CUDA_VISIBLE_DEVICES='-1' hides it)"),
        ({"XLA_FLAGS": f"{count}=0"}, f"XLA_FLAGS has '{count}=0': the CPU device count must be a whole number"),
        ({"XLA_FLAGS": f"{count}=-1"}, f"XLA_FLAGS has '{count}=-1'"),
        ({"XLA_FLAGS": f"--xla_cpu_enable_fast_math=false {count}=abc"}, f"XLA_FLAGS has '{count}=abc'"),
        ({"JAX_NUM_CPU_DEVICES": "abc"}, "JAX_NUM_CPU_DEVICES='abc' must be a whole number >= 1"),
        ({"JAX_NUM_CPU_DEVICES": "0"}, "JAX_NUM_CPU_DEVICES='0' must be a whole number >= 1"),
        ({"PJRT_NPROC": "abc"}, "PJRT_NPROC='abc' must be a whole number >= 1"),
        ({"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "lots"}, "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB='lots' must be"),
        ({"SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' must be a whole number"),
        ({"MTJAX_PROGRESS": "yes"}, "MTJAX_PROGRESS='yes' is not one of: always"),
    ]
    for i in range(0, len(cases), 4):
        batch = [(env, expect, start(tmp_path, [*train, f"--run.dir=r{j}"], env))
                 for j, (env, expect) in enumerate(cases[i:i + 4], i)]
        for env, expect, p in batch:
            check_one_line(p, env, expect)
    assert not list(tmp_path.iterdir())  # nothing was made, no temporary file left


# -- Ctrl-C during start-up -----------------------------------------------------------------------

# `python -m mtjax ARGS` that sends itself SIGINT at a chosen moment of start-up: when a
# module is first imported, or when a file is opened (an audit hook).
INTERRUPTED = """
import os, runpy, signal, sys
when, what = sys.argv[1], sys.argv[2]

class Finder:
    def find_spec(self, name, path=None, target=None):
        if when == "import" and name == what:
            os.kill(os.getpid(), signal.SIGINT)

def audit(event, args):
    if when == "open" and event == "open" and str(args[0]).endswith(what):
        os.kill(os.getpid(), signal.SIGINT)

sys.meta_path.insert(0, Finder())
sys.addaudithook(audit)
sys.argv = ["mtjax", *sys.argv[3:]]
runpy.run_module("mtjax", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow  # a few interpreter start-ups, JAX imported in most
def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    (tmp_path / "exp.yaml").write_text("run:\n  steps: 1\n")
    train = ["train", "exp.yaml", *TINY, "--run.dir=r"]
    moments = [
        (["import", "mtjax.cli"], "mtjax: interrupted"),  # before main() has its handler
        (["import", "jax"], "mtjax: interrupted"),  # while the command modules import JAX
        (["import", "mtjax.commands.store"], "mtjax: interrupted"),  # the last one, before the arguments are parsed
        (["open", "exp.yaml"], "mtjax train: interrupted"),  # while the config is loaded
    ]
    # The children get SIGINT as a terminal's foreground command has it, whatever this
    # process was started with (an ignored SIGINT is inherited, and mtjax then leaves it so).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        before = snapshot(tmp_path)
        procs = [(moment, expect, start(tmp_path, [*moment, *train], {}, code=INTERRUPTED))
                 for moment, expect in moments]
        for moment, expect, p in procs:
            check_one_line(p, moment, expect, rc=130)
        assert snapshot(tmp_path) == before
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_environment_check_in_process():
    """The checks themselves, without starting a process (the slow test above runs them
    through the command line)."""
    from mtjax import environment

    environment.check({"JAX_NUM_CPU_DEVICES": "4", "PJRT_NPROC": " 8 ", "JAX_PLATFORMS": "",
                       "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "MTJAX_PROGRESS": "always"})
    for env in ({"JAX_NUM_CPU_DEVICES": "²"}, {"PJRT_NPROC": "-3"}, {"MTJAX_PROGRESS": "Always"},
                {"XLA_FLAGS": "--xla_force_host_platform_device_count"}):
        with pytest.raises(environment.EnvironmentProblem):
            environment.check(env)
    assert environment.backend_failure(RuntimeError("Unable to initialize backend 'x'")) is None  # not raised by JAX
