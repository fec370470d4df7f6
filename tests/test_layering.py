"""The package's layering, read from its source: `ops/` is the product and imports only `runtime`,
`quant`, `spec` and other ops' public names; no module imports its way back to itself.

Every import counts, those inside functions too: a deferred import still ties two modules."""

import ast
from pathlib import Path

PACKAGE = "tritonformer"
ROOT = Path(__file__).resolve().parents[1] / "src" / PACKAGE
OPS_MAY_IMPORT = {f"{PACKAGE}.runtime", f"{PACKAGE}.quant", f"{PACKAGE}.spec"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str):
    """(imported module, imported names) for every import of the package's own modules in `name`."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in MODULES:
                    yield submodule, ()
                else:
                    yield target, (alias.name,)


def _graph() -> dict[str, set[str]]:
    return {name: {target for target, _ in _imports(name) if target in MODULES and target != name}
            for name in MODULES}


def test_ops_import_only_the_runtime_layer_and_public_op_names():
    wrong = []
    for name in MODULES:
        if not name.startswith(f"{PACKAGE}.ops."):
            continue
        for target, names in _imports(name):
            if target.startswith(f"{PACKAGE}.ops"):
                wrong += [f"{name} imports private {target}.{n}" for n in names if n.startswith("_")]
            elif target not in OPS_MAY_IMPORT:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph, done, path = _graph(), set(), []

    def visit(name):
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        path.append(name)
        for target in sorted(graph[name]):
            visit(target)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_the_check_sees_the_package():
    # The checks above pass vacuously if the walk finds nothing: it must see the ops and their imports.
    assert f"{PACKAGE}.ops.matmul" in MODULES and f"{PACKAGE}.runtime" in MODULES
    assert f"{PACKAGE}.runtime" in _graph()[f"{PACKAGE}.ops.add"]


def test_ops_plan_their_launches_through_the_one_runtime_mechanism():
    """Host fast paths go through runtime.planned: no op keeps a plan table or key of its own."""
    own_tables = [name for name, path in MODULES.items() if name.startswith(f"{PACKAGE}.ops")
                  for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Attribute) and node.attr in ("PlanTable", "tensor_key")]
    assert own_tables == []
    assert any(isinstance(node, ast.Attribute) and node.attr == "planned"
               for node in ast.walk(ast.parse(MODULES[f"{PACKAGE}.ops.norm"].read_text())))
