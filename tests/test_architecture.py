"""The layer table of docs/architecture.md, enforced on the imports (read from the source, functions included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "spmd_train"

# Module prefix -> layer; a module may import its own layer and those below, never above.
# The longest matching prefix decides (config.schema sits below the rest of config).
LAYERS = {
    "spmd_train.errors": 0,
    "spmd_train.registry": 0,
    "spmd_train.console_log": 0,
    "spmd_train.config": 0,
    "spmd_train.hardware": 0,
    "spmd_train.output_dir": 0,
    "spmd_train.units": 0,
    "spmd_train.launch_guard": 0,
    "spmd_train.mesh": 1,
    "spmd_train.devices": 1,
    "spmd_train.tpu_flags": 1,
    "spmd_train.sharding": 1,
    "spmd_train.kernels": 2,
    "spmd_train.ops": 3,
    "spmd_train.parallel": 4,
    "spmd_train.models": 5,
    "spmd_train.data": 6,
    "spmd_train.train": 6,
    "spmd_train.analysis": 6,
    "spmd_train.hf": 6,
    "spmd_train.cli": 7,
    "spmd_train.__main__": 7,
    "spmd_train": 7,
}
NO_JAX = ("spmd_train.errors", "spmd_train.config", "spmd_train.registry", "spmd_train.units")
"""Layers that must import no jax: the CLI reads configs before jax starts."""
MESH_FREE = ("spmd_train.kernels", "spmd_train.ops")
"""Layers that know nothing of meshes or shardings."""


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every package module `name` imports anywhere in its source (`from pkg import sub` counts as pkg.sub)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            exported = _bound_names(modules[base]) if base in modules else set()
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules and a.name not in exported else base
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t == "spmd_train" or t.startswith("spmd_train."))
    found.discard(name)
    return found


def _bound_names(path: Path) -> set[str]:
    """Names a package's `__init__` binds itself (an entry point may share its submodule's name)."""
    if path.name != "__init__.py":
        return set()
    tree = ast.parse(path.read_text())
    return {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}


def layer_of(name: str) -> int:
    """The layer of a module: that of its longest listed prefix."""
    prefix = max((p for p in LAYERS if name == p or name.startswith(p + ".")), key=len)
    return LAYERS[prefix]


def violations(root: Path = PACKAGE) -> list[str]:
    """Upward imports, cycles between modules, jax in the no-jax layers, meshes in the mesh-free ones,
    and model code reaching past `parallel`'s documented entry points."""
    modules = _modules(root)
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    found = []
    for name, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if dep in modules and layer_of(dep) > layer_of(name):
                found.append(f"{name} (layer {layer_of(name)}) imports {dep} (layer {layer_of(dep)})")
            if name.startswith("spmd_train.models") and dep.startswith("spmd_train.parallel."):
                found.append(f"{name} imports {dep}: model code calls only `spmd_train.parallel`'s entry points")
            if name.startswith(MESH_FREE) and dep.startswith(("spmd_train.mesh", "spmd_train.sharding")):
                found.append(f"{name} imports {dep}: kernels and ops know nothing of meshes")
        if not name.startswith("spmd_train.parallel") and _opens_shard_map(modules[name]):
            found.append(f"{name} calls shard_map: only `spmd_train.parallel` opens shard_map regions")
        if name.startswith(NO_JAX):
            source = modules[name].read_text()
            tree = ast.parse(source)
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{name} imports {n}: config and errors import no jax" for n in names
                          if n == "jax" or n.startswith("jax.")]
    found += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return found


def _opens_shard_map(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any((isinstance(n, ast.Attribute) and n.attr == "shard_map")
               or (isinstance(n, ast.Name) and n.id == "shard_map") for n in ast.walk(tree))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [[*g, g[0]] for g in groups]


def test_imports_follow_the_layer_table():
    found = violations()
    assert not found, "imports against docs/architecture.md's layer table:\n" + "\n".join(found)


def test_every_module_has_a_layer():
    assert all(any(n == p or n.startswith(p + ".") for p in LAYERS) for n in _modules(PACKAGE))


@pytest.mark.parametrize(("module", "added", "expected"), [
    ("spmd_train/ops/rope.py", "from spmd_train.models.layers import param\n", "imports spmd_train.models.layers"),
    ("spmd_train/sharding/arithmetic.py", "from spmd_train.sharding.constrain import constrain\n", "import cycle"),
    ("spmd_train/config/checks.py", "import jax\n", "config and errors import no jax"),
    ("spmd_train/models/moe.py", "from spmd_train.parallel.expert_dispatch import moe_ffn\n", "entry points"),
    ("spmd_train/kernels/flash_attention/kernel.py", "def f():\n    from spmd_train.sharding import layout\n",
     "know nothing of meshes"),
    ("spmd_train/train/engine.py", "def f(g, m):\n    return jax.shard_map(g, mesh=m)\n", "only `spmd_train.parallel`"),
])
def test_the_check_catches_an_upward_import_a_cycle_and_a_leak(tmp_path, module, added, expected):
    """Mutations: each added import (inside a function too) must be reported."""
    copy = tmp_path / "spmd_train"
    subprocess.run(["cp", "-r", str(PACKAGE), str(copy)], check=True)
    target = copy / Path(module).relative_to("spmd_train")
    target.write_text(target.read_text() + "\n" + added)
    found = violations(copy)
    assert any(expected in line for line in found), found


@pytest.mark.slow
def test_every_module_imports_on_its_own_with_an_empty_package_init(tmp_path):
    """No module relies on the package `__init__` importing others first (a hidden cycle would fail here)."""
    copy = tmp_path / "spmd_train"
    subprocess.run(["cp", "-r", str(PACKAGE), str(copy)], check=True)
    (copy / "__init__.py").write_text("")
    names = [n for n in _modules(copy) if n not in ("spmd_train", "spmd_train.__main__")]
    # One interpreter (jax imported once); before each module every spmd_train module is forgotten.
    script = (
        "import sys, importlib, traceback\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import jax\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'spmd_train' or m.startswith('spmd_train.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ': ' + traceback.format_exc(limit=2).splitlines()[-1])\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                            env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, check=False)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
