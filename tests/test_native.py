"""quasar.kernels.native tells 'this machine cannot build the kernels' (normal: skip) from 'the build failed' (a
defect: shown, and the test session fails), recovers from a compile that was killed, and builds into the
cache directory it is given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from quasar import files
from quasar.kernels import native

TESTS = Path(__file__).parent


def test_no_compiler_means_cannot_not_failed(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(files, "_cache_dir", tmp_path)
    module, status = native.try_build()
    if not native.cpu_has_avx2():
        assert status.state == "cannot" and "AVX2" in status.reason
    else:
        assert module is None and status.state == "cannot" and "no C++ compiler" in status.reason


@pytest.mark.skipif(native.cannot_build() is not None, reason=f"cannot build here: {native.cannot_build()}")
def test_a_broken_build_is_a_failure_with_the_compiler_error(monkeypatch, tmp_path):
    source = tmp_path / "src" / "broken.cpp"
    source.parent.mkdir()
    source.write_text("#include <torch/extension.h>\nint broken( { return 0; }\n")
    monkeypatch.setattr(files, "_cache_dir", tmp_path / "cache")
    module, status = native.try_build([source])
    assert module is None and status.state == "failed"
    assert "Error building extension" in status.reason or "error" in status.reason.lower()


def test_a_stale_torch_lock_left_by_a_killed_compile_is_removed(tmp_path):
    build = tmp_path / "kernels" / "cpu-x"
    build.mkdir(parents=True)
    (build / "lock").touch()  # torch's FileBaton: later compiles would wait on it forever
    with native.build_lock(build):
        assert not (build / "lock").exists()


def test_the_lock_is_held_while_one_process_builds(tmp_path):
    """A second process waits for the first one's compile instead of removing a live torch lock."""
    build = tmp_path / "b"
    code = ("import sys, time; from pathlib import Path; from quasar.kernels import native\n"
            "with native.build_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(3)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(build)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    (build / "lock").touch()  # the live compile's torch lock
    waiter = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from quasar.kernels import native\n"
                             "with native.build_lock(Path(sys.argv[1])): print(Path(sys.argv[1], 'lock').exists())",
                             str(build)], capture_output=True, text=True, timeout=60)
    holder.wait(timeout=30)
    assert waiter.returncode == 0 and waiter.stdout.strip() == "False"  # it waited until the holder was done


def test_kernels_build_into_the_process_cache_dir(monkeypatch, tmp_path):
    built = []
    monkeypatch.setattr(native, "_status", None)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "cannot_build", lambda: None)
    monkeypatch.setattr(native, "build", lambda directory, sources: built.append(directory) or "module")
    monkeypatch.setattr(files, "_cache_dir", tmp_path)
    assert native.kernel() == "module"
    assert built == [native.build_dir()] and built[0].is_relative_to(tmp_path / "kernels")


@pytest.mark.skipif(native.cannot_build() is not None, reason=f"cannot build here: {native.cannot_build()}")
def test_the_test_session_fails_when_the_kernels_do_not_build(tmp_path):
    """Not a skip of every kernel test: the whole session stops with the build error."""
    broken = tmp_path / "src" / "broken.cpp"
    broken.parent.mkdir()
    broken.write_text("int broken( {\n")
    code = ("import sys, pytest; from pathlib import Path; from quasar.kernels import native\n"
            f"native.SOURCES = [Path({str(broken)!r})]\n"
            "native.try_build.__defaults__ = (None, native.SOURCES)\n"
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {str(TESTS / 'test_kv_cache.py')!r}]))")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=TESTS)
    assert run.returncode == 1, run.stdout[-2000:]
    assert "failed to build" in run.stdout + run.stderr


@pytest.mark.skipif(native.cannot_build() is not None, reason=f"cannot build here: {native.cannot_build()}")
def test_the_environment_chooses_the_kernel_paths_and_a_missing_one_is_one_line(monkeypatch, tiny_model_dir):
    """QUASAR_INT8_PATH / QUASAR_FLOAT_PATH put the kernels on a path of this CPU when they load (every CPU with
    the kernels has avx2 and maddubs); a path the CPU lacks stops the program with one line, before any work."""
    kernel = native.kernel()
    assert str(native.build_dir()) == native.status().reason  # loading left the flags, hence the digest, as they were
    monkeypatch.setattr(native, "_status", None)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setenv("QUASAR_INT8_PATH", "maddubs")
    monkeypatch.setenv("QUASAR_FLOAT_PATH", "avx2")
    try:
        assert native.kernel() is kernel and (kernel.int8_path(), kernel.float_path()) == ("maddubs", "avx2")
    finally:
        kernel.use_int8_path("auto")
        kernel.use_float_path("auto")
    env = dict(os.environ, QUASAR_FLOAT_PATH="avx9000")
    run = subprocess.run([sys.executable, "-m", "quasar", "generate", "--model", str(tiny_model_dir), "--verifier",
                          "fp32", "--max-new-tokens", "1", "hi"], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 1 and run.stdout == ""
    assert "QUASAR_FLOAT_PATH=avx9000: float path 'avx9000' is not available on this CPU; available: auto" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_a_kernel_path_asked_for_where_the_kernels_cannot_load_is_said(monkeypatch, caplog):
    monkeypatch.setattr(native, "_status", None)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "try_build", lambda: (None, native.KernelStatus("cannot", "this CPU has no AVX2")))
    monkeypatch.setenv("QUASAR_FLOAT_PATH", "avx2")
    assert native.kernel() is None
    assert "QUASAR_FLOAT_PATH=avx2: no effect, quasar's kernels are not loaded (cannot: this CPU has no AVX2)" in caplog.text
