"""fairseq_ext.inference.native: what is loaded from the cache of built kernels is what this user built there.

A tiny C library built through :class:`NativeLibrary` (plain C: these tests run on every CPU with a C compiler).
A "planted" library, whose constructor creates a marker file when it is loaded, stands for another user's
library: it must never be loaded, whether it is reached through a symbolic link, sits in a directory another
user can write or own, or is swapped in while the loader looks. Also the switch ``FAIRSEQ_EXT_NATIVE=0``, the
compiler's timeout and the private cache of a process without a home directory.
"""

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from fairseq_ext.errors import FairseqExtError
from fairseq_ext.inference import native
from fairseq_ext.inference.native import NativeLibrary

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
CC = shutil.which("cc") or shutil.which("gcc")


def _library(src_dir, body="int fx_answer(void) { return 42; }\n", name="tiny"):
    source = Path(src_dir) / f"{name}.c"
    source.write_text(body)
    return NativeLibrary(name, source, ["-O1", "-shared", "-fPIC"], "a C compiler", lambda: None, lambda lib: None)


def _planted(directory, marker):
    """A library whose constructor creates ``marker`` (what another user's code would do when loaded)."""
    src = Path(directory) / "planted.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\nint fx_answer(void) {{ return 7; }}\n')
    out = Path(directory) / "planted.so"
    subprocess.run([CC, "-shared", "-fPIC", str(src), "-o", str(out)], check=True)
    return out


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fresh cache, the real compiler, a planted library and the marker it would create."""
    monkeypatch.setenv("CC", CC)
    monkeypatch.delenv(native.SWITCH, raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setenv("FAIRSEQ_EXT_CACHE", str(cache))
    (tmp_path / "src").mkdir()
    (tmp_path / "evil").mkdir()
    marker = tmp_path / "planted-library-ran"
    return {"tmp": tmp_path, "cache": cache, "src": tmp_path / "src", "marker": marker,
            "planted": _planted(tmp_path / "evil", marker)}


def _refused(lib, *fragments):
    with pytest.raises(FairseqExtError) as e:
        lib.load()
    assert "\n" not in str(e.value)
    for f in fragments:
        assert f in str(e.value), str(e.value)
    return str(e.value)


def test_a_library_is_built_once_and_loaded_from_its_checked_descriptor(env, monkeypatch):
    lib = _library(env["src"])
    assert lib.load().fx_answer() == 42
    built = env["cache"] / native.library_name(lib.source, lib.cflags)
    assert sorted(p.name for p in env["cache"].iterdir()) == [built.name]  # no temporary file left
    assert (env["cache"].stat().st_mode & 0o777) == 0o700
    stamp = built.stat().st_mtime_ns
    fake = env["tmp"] / "fake-cc"  # a compiler that would leave a mark: not run for a cached library
    fake.write_text(f"#!/bin/sh\ntouch {env['tmp'] / 'compiled'}\nexec {CC} \"$@\"\n")
    fake.chmod(0o755)
    again = _library(env["src"])
    monkeypatch.setattr(native, "library_name", lambda source, cflags: built.name)  # CC is part of the name
    monkeypatch.setenv("CC", str(fake))
    assert again.load().fx_answer() == 42
    assert built.stat().st_mtime_ns == stamp and not (env["tmp"] / "compiled").exists()
    assert not env["marker"].exists()


def test_a_symbolic_link_anywhere_in_the_cache_path_is_refused(env, monkeypatch):
    target = env["tmp"] / "target"
    target.mkdir(mode=0o700)
    lib = _library(env["src"])  # the planted library where the link leads, under the name the build looks for
    shutil.copy(env["planted"], target / native.library_name(lib.source, lib.cflags))
    os.symlink(target, env["cache"])  # the cache itself
    _refused(lib, f"{env['cache']} is a symbolic link")
    os.remove(env["cache"])
    (env["tmp"] / "real").mkdir(mode=0o700)
    os.symlink(env["tmp"] / "real", env["tmp"] / "link")  # a directory above it
    shutil.copytree(target, env["tmp"] / "real" / "cache")
    monkeypatch.setenv("FAIRSEQ_EXT_CACHE", str(env["tmp"] / "link" / "cache"))
    _refused(_library(env["src"]), f"{env['tmp'] / 'link'} is a symbolic link")
    assert not env["marker"].exists()


def test_a_library_that_is_a_symbolic_link_or_not_ours_alone_is_not_loaded(env):
    lib = _library(env["src"])
    env["cache"].mkdir(mode=0o700)
    path = env["cache"] / native.library_name(lib.source, lib.cflags)
    os.symlink(env["planted"], path)
    _refused(lib, f"{path} is a symbolic link")
    os.remove(path)
    shutil.copy(env["planted"], path)
    path.chmod(0o775)  # group-writable
    _refused(_library(env["src"]), f"{path} is not a file of this user's alone", "mode 775")
    if os.getuid() == 0:  # another user's file (only root can give one away)
        path.chmod(0o755)
        os.chown(path, 65534, 65534)
        _refused(_library(env["src"]), f"{path} is not a file of this user's alone", "owner uid 65534")
    assert not env["marker"].exists()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_cache_that_others_can_write_is_refused(env, mode):
    env["cache"].mkdir()
    env["cache"].chmod(mode)
    lib = _library(env["src"])
    shutil.copy(env["planted"], env["cache"] / native.library_name(lib.source, lib.cflags))
    _refused(lib, f"{env['cache']} is not a directory of this user's alone", f"mode {mode:o}")
    assert not env["marker"].exists()


def test_a_cache_of_another_user_is_refused(env, tmp_path, monkeypatch):
    if os.getuid() != 0:
        pytest.skip("only root can make a directory that another user owns")
    lib = _library(env["src"])
    env["cache"].mkdir(mode=0o700)
    shutil.copy(env["planted"], env["cache"] / native.library_name(lib.source, lib.cflags))
    os.chown(env["cache"], 65534, 65534)
    _refused(lib, f"{env['cache']} is not a directory of this user's alone", "owner uid 65534")
    # a directory above the cache that another user owns
    os.chown(env["cache"], 0, 0)
    above = tmp_path / "above"
    above.mkdir(mode=0o755)
    os.chown(above, 65534, 65534)
    monkeypatch.setenv("FAIRSEQ_EXT_CACHE", str(above / "cache"))
    _refused(_library(env["src"]), f"{above} could be changed by another user")
    assert not env["marker"].exists()


def test_a_library_swapped_for_a_link_while_loading_is_never_the_planted_one(env, monkeypatch):
    """The race of a path opened twice (checked, then loaded by name): while a library is loaded, a thread flips
    its name between the genuine file and a link to the planted one. A loaded library is always the genuine one
    (or the load is refused); the planted one never runs. Each try uses a new cache (the dynamic loader would
    hand back a library it already loaded under the same name without opening the file again)."""
    lib = _library(env["src"])
    assert lib.load().fx_answer() == 42
    name = native.library_name(lib.source, lib.cflags)
    genuine = env["tmp"] / "genuine.so"
    shutil.copy(env["cache"] / name, genuine)
    loaded = refused = 0
    for i in range(60):
        cache = env["tmp"] / f"cache{i}"
        cache.mkdir(mode=0o700)
        path = cache / name
        shutil.copy(genuine, path)
        monkeypatch.setenv("FAIRSEQ_EXT_CACHE", str(cache))
        stop = threading.Event()

        def flip():
            while not stop.is_set():
                for kind in ("link", "file"):
                    tmp = cache / f"next-{kind}"
                    if kind == "file":
                        shutil.copy(genuine, tmp)
                    else:
                        os.symlink(env["planted"], tmp)
                    os.replace(tmp, path)

        t = threading.Thread(target=flip)
        t.start()
        try:
            assert _library(env["src"]).load().fx_answer() == 42
            loaded += 1
        except FairseqExtError as e:
            assert "is a symbolic link" in str(e), str(e)
            refused += 1
        finally:
            stop.set()
            t.join()
        assert not env["marker"].exists(), f"the planted library was loaded (try {i}, after {loaded} genuine loads)"
    assert loaded + refused == 60


def test_without_a_home_directory_the_cache_is_a_new_private_directory(env, monkeypatch, tmp_path):
    """The old fallback, /tmp/fairseq_ext-UID, could be made first by another user; now mkdtemp makes one."""
    monkeypatch.delenv("FAIRSEQ_EXT_CACHE")
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: (_ for _ in ()).throw(RuntimeError("no home"))))
    monkeypatch.setattr(native, "_private_cache", None)
    monkeypatch.setattr(native.tempfile, "tempdir", str(tmp_path))
    lib = _library(env["src"])
    squatted = tmp_path / f"fairseq_ext-{os.getuid()}"  # what another user could have made first
    squatted.mkdir(mode=0o777)
    squatted.chmod(0o777)
    shutil.copy(env["planted"], squatted / native.library_name(lib.source, lib.cflags))
    assert lib.load().fx_answer() == 42
    cache = native.cache_dir()
    assert cache.parent == tmp_path and cache.name.startswith("fairseq_ext-") and cache != squatted
    assert (cache.stat().st_mode & 0o777) == 0o700 and native.cache_dir() == cache  # one per process
    assert not env["marker"].exists()


def test_fairseq_ext_native_0_turns_every_native_path_off(env, monkeypatch):
    from fairseq_ext.inference import amx_int8

    fake = env["tmp"] / "fake-cc"
    fake.write_text(f"#!/bin/sh\ntouch {env['tmp'] / 'compiled'}\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv(native.SWITCH, "0")
    assert _refused(_library(env["src"])) == "tiny unavailable: native code turned off by FAIRSEQ_EXT_NATIVE=0"
    monkeypatch.setattr(amx_int8.LIBRARY, "lib", None)
    monkeypatch.setattr(amx_int8.LIBRARY, "why", None)
    assert amx_int8.refusal() == "AMX int8 kernel unavailable: native code turned off by FAIRSEQ_EXT_NATIVE=0"
    assert not (env["tmp"] / "compiled").exists() and not env["cache"].exists()


def test_a_compiler_that_hangs_is_stopped(env, monkeypatch):
    """A hanging CC (here a wrapper whose child sleeps, then would write the library) is stopped with everything
    it started after COMPILE_TIMEOUT_S: one line, no temporary library left, nothing written afterwards."""
    late = env["tmp"] / "written-after-the-timeout"
    fake = env["tmp"] / "hanging-cc"
    fake.write_text(f"#!/bin/sh\nsh -c 'sleep 2; touch {late}' &\nwait\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setattr(native, "COMPILE_TIMEOUT_S", 0.5)
    start = time.monotonic()
    why = _refused(_library(env["src"]), "hanging-cc did not build tiny.c within 0.5 s (stopped)")
    assert time.monotonic() - start < 2, why
    assert list(env["cache"].iterdir()) == []
    time.sleep(2.5)
    assert not late.exists(), "the compiler's child ran on after the timeout"
