"""The tree's import graph, read from the code (every import, at the top of a module or
inside a function): no circle between modules, no role reaching into another role (what
roles share is in serving/, beside roles/, which imports no role: serving/replicas.py,
serving/haproxy/, serving/container_unit/ ..., or the engine), and roles/ holding roles alone."""
import ast
from pathlib import Path

from roles import ORDER
from tests.conftest import ROOT

PACKAGES = ("cli", "converge", "credentials", "day2", "lab", "reference", "relay", "roles", "serving")


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {"tasks": ROOT / "tasks.py"}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "tests" not in path.relative_to(ROOT).parts:
                found[_module_of(path)] = path
    return found


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The tree's modules that ``module`` imports (``from pkg import name`` counts ``pkg.name``
    when that is a module, else ``pkg``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        out.update(name for name in names if name in known and name != module)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_the_graph_is_read_from_the_code():
    graph = _graph()
    assert "serving.serving_host" in graph["roles.service.role"]
    assert "roles.preflight.placement" in graph["roles.preflight.select"]  # a relative import, resolved
    assert "cli.runs" in graph["cli.day2"]


def test_no_module_imports_itself_through_others():
    graph = _graph()
    circles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def _role_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "roles" and len(parts) >= 2 and parts[1] in ORDER else None


def test_no_role_imports_another_role():
    """Not its role.py, nor any of its modules: what two roles both need is a library."""
    graph = _graph()
    reaching = sorted(f"{module} -> {other}" for module, imported in graph.items() for other in imported
                      if _role_of(module) and _role_of(other) and _role_of(other) != _role_of(module))
    assert not reaching, reaching


def test_roles_holds_roles_alone():
    """Every folder of roles/ is a role of ORDER (its role.py, schema.yml, defaults/...), and beside
    them only roles/__init__.py (which, and in what order) and the testinfra checks' conftest.py."""
    folders = sorted(p.name for p in (ROOT / "roles").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert folders == sorted(ORDER), folders
    for name in ORDER:
        assert (ROOT / "roles" / name / "role.py").is_file() and (ROOT / "roles" / name / "schema.yml").is_file()
    loose = sorted(p.name for p in (ROOT / "roles").iterdir() if p.is_file())
    assert loose == ["__init__.py", "conftest.py"], loose


def test_what_the_roles_share_imports_no_role():
    """serving/haproxy/, serving/replicas.py, serving/vllm_serve/ ...: shared by the roles, below them
    all; none of it reaches back up into roles/, not even roles/__init__.py."""
    graph = _graph()
    libraries = [m for m in graph if m == "serving" or m.startswith("serving.")]
    assert {"serving.haproxy.steps", "serving.replicas", "serving.vllm_serve", "serving.container_unit"} <= set(libraries)
    reaching = sorted(f"{module} -> {other}" for module in libraries for other in graph[module]
                      if other == "roles" or other.startswith("roles."))
    assert not reaching, reaching
