"""Counting a kernel's compiled variants: the key Triton's JIT compiles under, computed on the host.

Triton compiles a kernel once per distinct launch key: each argument's type
and specialization (an int equal to 1 becomes a constant, an int or pointer
that is a multiple of 16 gets an alignment hint; parameters in the kernel's
`do_not_specialize` get neither), every constexpr's value, and the launch
options (num_warps). `launch_key` computes that key with Triton's own
`native_specialize_impl`, so it works under TRITON_INTERPRET=1, where
nothing is compiled, exactly as on a GPU. `Variants` watches kernels of a
module, lets their launches run, and counts the distinct keys: a test can
prove a sequence of differently shaped steps compiles a bounded number of
times, and bench/gpu_check.py prints the count next to the JIT cache's own.
Knows nothing about attention.
"""

from __future__ import annotations

import inspect
from collections import defaultdict

from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend


def _params(kernel) -> list[tuple[str, bool, bool, object]]:
    """(name, is constexpr, not specialized, default) per parameter of a JITFunction or InterpretedFunction."""
    dns = getattr(kernel, "do_not_specialize", None)
    if dns is None:  # the interpreter keeps the decorator's arguments
        dns = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    out = []
    for i, p in enumerate(inspect.signature(kernel.fn).parameters.values()):
        const = "constexpr" in str(p.annotation)
        out.append((p.name, const, i in dns or p.name in dns, p.default))
    return out


def launch_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """What the JIT caches one launch's compile under (see the module docstring)."""
    params = _params(kernel)
    names = [name for name, *_ in params]
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    bound = dict(zip(names, args))
    bound.update((k, v) for k, v in kwargs.items() if k in names)
    key = []
    for name, const, no_spec, default in params:
        value = bound.get(name, default)
        if const:
            key.append(("constexpr", str(value)))
        else:
            key.append(native_specialize_impl(BaseBackend, value, False, not no_spec, True))
    return tuple(key) + options


class Variants:
    """`with Variants({module: [kernel names]}) as v:` launches run as usual; v.counts() after.

    Counts through the kernel objects themselves (an instance `run` that
    records the key, then calls the class's): launchers keep calling the
    same object, so `is_interpreted` and every other check still see it.
    """

    def __init__(self, kernels: dict) -> None:
        self.kernels = [(name, getattr(module, name)) for module, names in kernels.items() for name in names]
        self.keys: dict[str, set] = defaultdict(set)

    def __enter__(self) -> "Variants":
        for name, kernel in self.kernels:
            kernel.run = self._counting(kernel, self.keys[name])
        return self

    @staticmethod
    def _counting(kernel, keys: set):
        run = type(kernel).run

        def counted(*args, grid, warmup, **kwargs):
            keys.add(launch_key(kernel, args, kwargs))
            return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        return counted

    def __exit__(self, *exc) -> None:
        for _, kernel in self.kernels:
            del kernel.run

    def counts(self) -> dict[str, int]:
        return {name: len(self.keys[name]) for name, _ in self.kernels}
