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


# One constant of cpu_decode.c changed: the weight of the second of each pair of value rows of a float pool
# is scaled by 1.001 instead of 1. A test that cannot see a 0.1% error in one row of two would pass it.
WRONG_CONSTANT = ("s1 = a->vs ? a->vs[r1] : 1.0f", "s1 = a->vs ? a->vs[r1] : 1.001f")


def test_a_kernel_with_one_wrong_constant_fails_the_reference_comparison(tmp_path, monkeypatch):
    """cpu_decode.c built from a copy with one constant changed fails the comparison test_cpu_decode.py makes
    (kernel against the torch reference, its tolerance), which the real kernel passes on the same case."""
    import torch
    from test_cpu_decode import assert_close, case  # tests/kernels is on sys.path
    from test_kernel_attention import Pool

    require_kernels()  # the real kernel (a machine without a compiler skips here, saying so)
    source = cpu_build.SOURCES[0]
    assert source.name == "cpu_decode.c" and source.read_text().count(WRONG_CONSTANT[0]) == 1
    wrong = tmp_path / "cpu_decode.c"
    wrong.write_text(source.read_text().replace(*WRONG_CONSTANT))
    monkeypatch.setenv("STREAMCHAT_KERNEL_CACHE", str(tmp_path / "kernels"))
    wrong_lib = require_kernels([wrong])

    pool = Pool([1, 37, 70, cpu.RUN_TOKENS * 2 + 5], num_kv_heads=2, head_dim=64, block_size=16,
                dtype=torch.float32)
    out, ref, _, _ = case(pool, 6, 64)
    assert_close(out, ref)
    monkeypatch.setattr(cpu, "_lib", wrong_lib)
    monkeypatch.setattr(cpu, "_tried", True)
    out, ref, _, _ = case(pool, 6, 64)
    with pytest.raises(AssertionError, match="not close"):
        assert_close(out, ref)
