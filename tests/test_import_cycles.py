"""No import cycles: between modules, between `pd`'s rooms (its subpackages and top-level
modules) and between the top-level packages, every one of them (`launch/` and `deploy/`
included). The KV core knows nothing of requests' PD fields, connectors implement `pd`'s
connector API and `pd` names them only as strings, `pd` imports neither the CLI nor the
proxy nor the benchmarks, models and workers do not lean on each other.

Every import counts, at module level or inside a function (a lazy import is still a
dependency), `if TYPE_CHECKING:` ones too. A module is a node; so is a room and a
top-level package. `from pkg import mod` depends on `pkg.mod` alone (not on
`pkg/__init__.py`).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_CODE = {"tests", "docs", "build", "dist"}


def top_level_packages(root: Path = ROOT) -> list[str]:
    """Every top-level folder that holds Python code (a package, or scripts as deploy/)."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and p.name not in NOT_CODE and any(p.rglob("*.py")))


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for package in top_level_packages(root):
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imported_names(tree: ast.AST, package: str) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
            names.add(base)
    return names


def module_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = imported_names(ast.parse(path.read_text(), str(path)), package)
        for target in {resolve(n) for n in imported}:
            # `from pkg import mod` names pkg too: pkg's __init__ only when no module is named
            is_parent_of_named = target is not None and any(
                resolve(n) not in (None, target) and n.startswith(target + ".") for n in imported)
            if target not in (None, name) and not (is_parent_of_named and found[target].name == "__init__.py"):
                graph[name].add(target)
    return graph


def room(module: str) -> str:
    """The room of `pd` a module is in (`pd.kv_cache`, `pd.llm`), or its top-level package."""
    parts = module.split(".")
    if parts[0] == "pd" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def top_level(module: str) -> str:
    return module.split(".")[0]


def package_graph(graph: dict[str, set[str]], unit=room) -> dict[str, set[str]]:
    """The graph between units (rooms, or top-level packages with `unit=top_level`)."""
    packages: dict[str, set[str]] = defaultdict(set)
    for source, targets in graph.items():
        for target in targets:
            if unit(source) != unit(target) and target != "pd":
                packages[unit(source)].add(unit(target))
    return packages


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def explain(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} -> {b}" for a in component for b in sorted(graph.get(a, ())) if b in component]


def test_no_module_imports_itself_back() -> None:
    graph = module_graph(modules())
    assert {c[0]: explain(c, graph) for c in cycles(graph)} == {}


def test_no_room_of_pd_imports_itself_back() -> None:
    graph = package_graph(module_graph(modules()))
    assert {c[0]: explain(c, graph) for c in cycles(graph)} == {}


def test_no_top_level_package_imports_itself_back() -> None:
    found = modules()
    assert {"pd", "cli", "connectors", "proxy", "planner", "kv_events", "benchmarks", "launch", "deploy", "telemetry",
            "wire"} <= {top_level(name) for name in found}  # every package is read
    graph = package_graph(module_graph(found), unit=top_level)
    assert {c[0]: explain(c, graph) for c in cycles(graph)} == {}


def test_pd_imports_neither_the_cli_nor_the_proxy_nor_the_benchmarks() -> None:
    graph = package_graph(module_graph(modules()), unit=top_level)
    assert graph["pd"] & {"cli", "proxy", "benchmarks", "deploy", "connectors"} == set()


def test_telemetry_and_the_wire_import_nothing_of_ours_and_the_proxy_only_what_lies_below_it() -> None:
    graph = package_graph(module_graph(modules()), unit=top_level)
    assert graph["wire"] - {"wire"} == set()
    assert graph["telemetry"] - {"telemetry"} <= {"wire"}  # the trace headers' names
    assert graph["proxy"] - {"proxy"} <= {"kv_events", "launch", "telemetry", "wire"}
    assert graph["planner"] - {"planner"} <= {"launch", "telemetry", "wire"}  # HTTP; launch: its launchers


def test_the_walk_finds_a_cycle_added_on_purpose(tmp_path) -> None:
    for package in ("pd", "connectors"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "pd" / "a.py").write_text("from pd.b import thing\n")
    (tmp_path / "pd" / "b.py").write_text("def f():\n    from pd import a\n")
    (tmp_path / "connectors" / "c.py").write_text("import pd.a\n")
    graph = module_graph(modules(tmp_path))
    assert cycles(graph) == [["pd.a", "pd.b"]]
    assert cycles(package_graph(graph)) == [["pd.a", "pd.b"]]


def test_the_walk_finds_a_cycle_between_top_level_packages(tmp_path) -> None:
    for package in ("pd", "proxy", "deploy"):
        (tmp_path / package).mkdir()
    (tmp_path / "pd" / "__init__.py").write_text("")
    (tmp_path / "pd" / "cli.py").write_text("from proxy.app import build\n")  # pd -> proxy
    (tmp_path / "proxy" / "app.py").write_text("def build():\n    import pd.llm\n")  # proxy -> pd
    (tmp_path / "pd" / "llm.py").write_text("")
    (tmp_path / "deploy" / "run.py").write_text("import proxy.app\n")  # a script folder: no cycle
    graph = module_graph(modules(tmp_path))
    assert cycles(graph) == [] and cycles(package_graph(graph)) == []  # no module or room cycle
    assert cycles(package_graph(graph, unit=top_level)) == [["pd", "proxy"]]


def test_modules_under_tests_import_no_test_module() -> None:
    """Tests share code only through tests/support/: no test module, conftest or support
    module imports a test module or a conftest, by package path or by bare name."""
    tests = ROOT / "tests"
    test_modules = {p.stem for p in tests.rglob("*.py") if p.stem.startswith("test_") or p.stem == "conftest"}
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        for name in imported_names(ast.parse(path.read_text(), str(path)), "tests"):
            parts = name.split(".")
            if (parts[0] == "tests" and parts[1:2] != ["support"]) or parts[0] in test_modules:
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert offenders == []


# What pd/contracts/ may import: the KV core and what lies under it (pd's bottom floor).
BELOW_THE_CONTRACTS = {"pd.contracts", "pd.kv_cache", "pd.kv_transfer", "pd.structured", "pd.logprobs",
                       "pd.errors", "pd.registry", "kv_events", "wire"}


def test_the_contracts_depend_on_nothing_above_the_kv_core() -> None:
    graph = package_graph(module_graph(modules()))
    assert graph["pd.contracts"] - BELOW_THE_CONTRACTS == set()


def test_only_the_engine_core_imports_the_scheduler() -> None:
    """The types rooms share live in pd/contracts/: no worker, connector, server, offload
    tier or benchmark reaches into the scheduler's room for them. The one other importer
    is the simulator's engine model, which takes its steps by the scheduler's own step
    budget (its logic, not a type), and nothing else of the room."""
    graph = module_graph(modules())
    importers = {source for source, targets in graph.items() if room(source) != "pd.scheduling"
                 and any(room(target) == "pd.scheduling" for target in targets)}
    assert importers == {"pd.engine.core", "benchmarks.sim.engine"}
    assert {t for t in graph["benchmarks.sim.engine"] if room(t) == "pd.scheduling"} == {"pd.scheduling.step_budget"}
