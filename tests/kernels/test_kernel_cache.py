"""Tests of the kernel cache: a private folder, and a library loaded only if no one else can have changed it."""

import logging
import os
import shutil
import stat

import pytest
import torch

from streamchat.kernels import cpu, cpu_build

FRESH = b"\x7fELF a fresh build"


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder the builds go to, and a compiler that writes FRESH (counting its calls)."""
    folder = tmp_path / "cache" / "kernels"
    monkeypatch.setenv("STREAMCHAT_KERNEL_CACHE", str(folder))
    calls = []

    def fake_compile(cc, sources, out):
        calls.append(out)
        with open(out, "wb") as f:
            f.write(FRESH)

    monkeypatch.setattr(cpu_build, "_compile", fake_compile)
    return folder, calls


def test_the_folder_is_made_private_and_a_build_is_reused(cache):
    """A missing cache folder is made 0700; the build is 0600, ours, and found again without compiling."""
    folder, calls = cache
    first = cpu_build.build("cc")
    assert first.parent == folder and mode(folder) == 0o700 and mode(first) == 0o600
    assert first.read_bytes() == FRESH and first.stat().st_uid == os.geteuid() and len(calls) == 1
    assert cpu_build.build("cc") == first and len(calls) == 1


@pytest.mark.parametrize("spoil", ["world-writable", "group-writable", "another-owner", "link"])
def test_a_library_others_could_change_is_rebuilt_never_loaded(cache, caplog, tmp_path, spoil):
    """A cached library others may write, another uid owns, or that is a link, is replaced by a fresh
    private build, with a warning naming why."""
    folder, calls = cache
    target = cpu_build.build("cc")
    target.unlink()
    if spoil == "link":
        (tmp_path / "planted.so").write_bytes(b"planted")
        target.symlink_to(tmp_path / "planted.so")
    else:
        target.write_bytes(b"planted")
    why = {"world-writable": "may be written by others (mode 666)",
           "group-writable": "may be written by others (mode 620)",
           "another-owner": "belongs to uid 54321", "link": "is a symbolic link"}[spoil]
    if spoil == "world-writable":
        os.chmod(target, 0o666)
    elif spoil == "group-writable":
        os.chmod(target, 0o620)
    elif spoil == "another-owner":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another uid needs root")
        os.chown(target, 54321, 54321)
    with caplog.at_level(logging.WARNING, logger="streamchat.kernels"):
        assert cpu_build.build("cc") == target
    assert target.read_bytes() == FRESH and mode(target) == 0o600 and target.stat().st_uid == os.geteuid()
    assert len(calls) == 2 and f"not loading the kernel library: {target} {why}" in caplog.text


def test_a_folder_others_may_write_is_refused_and_nothing_loaded(cache, caplog, monkeypatch):
    """In a cache folder of mode 0777 nothing is built or loaded: library() says why and returns None."""
    folder, calls = cache
    folder.mkdir(parents=True)
    os.chmod(folder, 0o777)
    planted = folder / "cpu_decode-0123456789abcdef.so"
    planted.write_bytes(b"planted")
    with pytest.raises(cpu_build.UntrustedCache, match=f"kernel cache {folder} may be written by others"):
        cpu_build.build("cc")
    loaded = []
    monkeypatch.setattr(cpu.ctypes, "CDLL", lambda path: loaded.append(path))
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_lib", None)
    with caplog.at_level(logging.WARNING, logger="streamchat.kernels"):
        assert cpu.library() is None
    assert loaded == [] and calls == [] and sorted(os.listdir(folder)) == [planted.name]
    assert (f"the CPU decode kernel is not loaded: kernel cache {folder} may be written by others (mode 777); "
            "set STREAMCHAT_KERNEL_CACHE") in caplog.text


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                    reason=f"no C compiler ({os.environ.get('CC', 'cc')!r} is not on PATH): nothing is built")
def test_a_rebuilt_library_loads_and_runs(tmp_path, monkeypatch):
    """A fresh private build over a spoiled file is what library() loads, and it computes."""
    built = cpu.library()._name  # this machine's real build (in the default cache)
    monkeypatch.setenv("STREAMCHAT_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(cpu_build, "_compile", lambda cc, sources, out: shutil.copyfile(built, out))
    target = cpu_build.build("cc")
    os.chmod(target, 0o666)
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_lib", None)
    lib = cpu.library()
    assert lib is not None and lib._name == str(target) and mode(target) == 0o600
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    expect = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(cpu.rms_norm(x, torch.ones(64), 1e-6), expect)
