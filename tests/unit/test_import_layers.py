"""The import graph of service/ and worker/, read from the source (every import statement, inside functions and
`if TYPE_CHECKING:` blocks too, relative imports resolved): no module imports itself through others, and each
layer imports only what lies beneath it.

Layers, bottom up:
- contract (service/contract/): what every process shares (the wire, settings, limits, socket auth, block
  hashes, the configuration exit); it imports nothing of blockserve outside itself.
- scheduler (service/scheduler/) and api (service/api/): the contract, never each other, never the worker.
- worker (worker/): of service/ only the contract.
- tools (service/tools/: bench, the simulator, the model-free worker, workloads): the contract and the scheduler.
- composition root (service/launch/: the CLI, the supervisor): anything; nothing imports it.

An edge goes to the module an import names: `from service.contract import wire` names service.contract.wire,
`from service.api import create_app` the package service.api (its __init__).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP_PACKAGES = ("service", "worker")

# layer -> (module prefix, the layers it may import besides its own)
LAYERS = {
    "contract": ("service.contract", ()),
    "scheduler": ("service.scheduler", ("contract",)),
    "api": ("service.api", ("contract",)),
    "worker": ("worker", ("contract",)),
    "tools": ("service.tools", ("contract", "scheduler")),
    "composition root": ("service.launch", ("contract", "scheduler", "api", "worker", "tools")),
}
PACKAGE_ROOTS = ("service",)  # a namespace for layers, in no layer itself


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of TOP_PACKAGES it imports, for every .py file under root's TOP_PACKAGES."""
    paths = {module_name(path, root): path for top in TOP_PACKAGES for path in (root / top).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in paths]
                imported.update(submodules)
                if len(submodules) < len(node.names):
                    imported.add(base)
        graph[name] = {module for module in imported if module in paths and module != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, str] = {}  # visiting | done
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "visiting"
        stack.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "visiting":
                return stack[stack.index(imported) :] + [imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        stack.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def layer_of(module: str) -> str | None:
    for layer, (prefix, _) in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def layer_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Each import that crosses the layers the wrong way, and each module in no layer."""
    breaks = []
    for module, imported in sorted(graph.items()):
        layer = layer_of(module)
        if layer is None:
            if module not in PACKAGE_ROOTS:
                breaks.append(f"{module} is in no layer (put it in one of {', '.join(LAYERS)})")
            continue
        allowed = {layer, *LAYERS[layer][1]}
        for target in sorted(imported):
            target_layer = layer_of(target)
            if target_layer not in allowed:
                breaks.append(f"{module} ({layer}) imports {target} ({target_layer or 'no layer'})")
    return breaks


def test_service_and_worker_import_no_module_through_itself():
    cycle = find_cycle(import_graph(ROOT))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_each_layer_imports_only_the_layers_beneath_it():
    breaks = layer_breaks(import_graph(ROOT))
    assert not breaks, "layer breaks:\n" + "\n".join(breaks)


def test_the_check_finds_a_cycle_through_a_function_and_a_relative_import_and_names_a_layer_break(tmp_path):
    files = {
        "service/__init__.py": "",
        "service/contract/__init__.py": "",
        "service/contract/wire.py": "def decode():\n    from service.scheduler import engine\n",
        "service/scheduler/__init__.py": "",
        "service/scheduler/engine.py": "from ..contract import wire\n",
        "worker/__init__.py": "",
        "worker/runner.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import service.scheduler.engine\n",
    }
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    graph = import_graph(tmp_path)

    assert find_cycle(graph) == ["service.contract.wire", "service.scheduler.engine", "service.contract.wire"]
    assert layer_breaks(graph) == [
        "service.contract.wire (contract) imports service.scheduler.engine (scheduler)",
        "worker.runner (worker) imports service.scheduler.engine (scheduler)",
    ]
