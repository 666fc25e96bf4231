"""The package's layers: no import runs upward, no engine module grows past its size, the front needs no torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Lowest first. A module may import its own layer and those below, never above. Packages count as
# one unit; the kernels, client and migrations folders are mapped into the package (pyproject).
LAYERS = {
    "streamchat.config": 0, "streamchat.logs": 0, "streamchat.private_files": 0, "streamchat.settings": 0,
    "streamchat.priority": 0,
    "streamchat.cache": 1, "streamchat.text": 1,
    "streamchat.kernels": 2, "streamchat.store": 2, "streamchat.migrations": 2,
    "streamchat.model": 3, "streamchat.errors": 3,
    "streamchat.tiers": 4, "streamchat.evaluate_policies": 4, "streamchat.autotune": 4,
    "streamchat.engine": 5,
    "streamchat.evaluate": 6, "streamchat.llm": 6,
    "streamchat.server": 7, "streamchat.client": 7,
    "streamchat.cli": 8, "streamchat.__main__": 8,
}
FOLDERS = {"streamchat": "streamchat", "kernels": "streamchat.kernels", "client": "streamchat.client",
           "migrations": "streamchat.migrations"}


def unit(module: str) -> str | None:
    """The layered unit a dotted module name belongs to (None: not ours, or not placed yet)."""
    if module == "streamchat":  # the package itself: nothing but its docstring
        return "streamchat.config"
    name = ".".join(module.split(".")[:2])
    return name if name in LAYERS else None


def modules():
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            name = ".".join([package, *rel.parts]).removesuffix(".__init__")
            yield name, path


def imports(path: Path, name: str):
    """Every streamchat module `path` imports, at any depth of its code (lazy imports included)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                yield f"{base}.{node.module}" if node.module else base
            elif node.module:
                yield node.module
                yield from (f"{node.module}.{a.name}" for a in node.names)


def test_every_module_has_a_layer():
    """A new top-level module or package gets a place in LAYERS (so the rule below covers it)."""
    assert [n for n, _ in modules() if unit(n) is None] == []
    assert all(unit(t) is not None for n, p in modules() for t in imports(p, n)
               if t.startswith("streamchat.") and t.count(".") == 1 and not t.endswith("__version__"))


def test_no_import_runs_upward():
    """tiers never import the engine, the model never imports the evaluation, the engine never the server."""
    upward = []
    for name, path in modules():
        mine = LAYERS[unit(name)]
        for target in set(imports(path, name)):
            other = unit(target)
            if other is not None and LAYERS[other] > mine:
                upward.append(f"{name} -> {target}")
    assert sorted(upward) == []


@pytest.mark.parametrize("folder", ["streamchat/engine"])
def test_no_engine_module_is_over_300_lines(folder):
    sizes = {p.name: len(p.read_text().splitlines()) for p in sorted((ROOT / folder).glob("*.py"))}
    assert {name: n for name, n in sizes.items() if n > 300} == {}


def test_the_front_imports_no_torch():
    """The daemon's front (server, store, engine client, tokenizer) runs without torch or transformers."""
    code = ("import sys; import streamchat.server.app, streamchat.server.connection, streamchat.server.openai_http, "
            "streamchat.engine.core_client, streamchat.text.tokenizer, streamchat.cli; "
            "print(sorted(m for m in ('torch', 'transformers', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
