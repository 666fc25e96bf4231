"""A kernel that does not compile fails the kernel tests; only a machine without a C compiler skips them."""

import pytest

from streamchat.kernels import cpu, cpu_build

from kernel_build import require_kernels  # tests/ is on sys.path (its conftest.py)

BROKEN = "#include \"cpu_common.h\"\nint paged_decode(void) { return missing_name; }\n"


def outcome_of(call) -> BaseException | None:
    """What `call()` raised (pytest's skip and fail included), or None."""
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - Skipped and Failed are BaseExceptions
        return exc
    return None


@pytest.fixture
def broken(tmp_path, monkeypatch):
    """A kernel source that does not compile, and a private kernel cache of this test's own."""
    require_kernels()  # a machine without a compiler skips here, saying so
    monkeypatch.setenv("STREAMCHAT_KERNEL_CACHE", str(tmp_path / "kernels"))
    source = tmp_path / "broken_kernel.c"
    source.write_text(BROKEN)
    return source


def test_a_source_that_does_not_compile_fails_rather_than_skips(broken):
    """Built through cpu_build (the same compiler, flags and headers), the broken source's error is the
    failure's message."""
    exc = outcome_of(lambda: require_kernels([broken]))
    assert isinstance(exc, pytest.fail.Exception), f"expected a failure, got {exc!r}"
    assert "the CPU kernels failed to build with" in str(exc) and "missing_name" in str(exc)


def test_the_process_library_failing_to_build_fails_too(broken, monkeypatch):
    """library() logs a failed build and returns None (the daemon runs the reference); the tests'
    helper builds again and fails with the compiler's error instead of skipping."""
    monkeypatch.setattr(cpu_build, "SOURCES", [broken])
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_lib", None)
    assert cpu.library() is None
    exc = outcome_of(require_kernels)
    assert isinstance(exc, pytest.fail.Exception), f"expected a failure, got {exc!r}"
    assert "missing_name" in str(exc)


def test_no_compiler_skips_and_says_so(monkeypatch):
    monkeypatch.setenv("CC", "streamchat-no-such-compiler")
    exc = outcome_of(require_kernels)
    assert isinstance(exc, pytest.skip.Exception), f"expected a skip, got {exc!r}"
    assert "no C compiler ('streamchat-no-such-compiler' is not on PATH)" in str(exc)
