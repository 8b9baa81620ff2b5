"""The code's shape, checked with ``ast`` only: no import cycle between product modules, stages that import no
other stage, a front end whose protocol packages import no other protocol and whose core imports none, and files
and functions short enough to read.

Product modules are the installed ``epdserve`` package: ``epdserve/`` (shared code) and the stage folders that
pyproject.toml maps under it (``gateway/``, ``encoder/``, ``prefill/``, ``decode/``), ``proto/`` and
``benchmarks/`` (``epdserve.bench``, without its ``results/`` records). Every import counts, also one inside a
function or under ``TYPE_CHECKING``: a lazy import hides a cycle from the interpreter, not from a reader.
"""

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("gateway", "encoder", "prefill", "decode")
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def _package_dirs() -> dict[str, Path]:
    """Import name -> folder, from pyproject.toml's package-dir (the single source of the mapping)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in setuptools["package-dir"].items()}


def _modules() -> dict[str, Path]:
    """Every product module's import name -> its file."""
    dirs = _package_dirs()
    out: dict[str, Path] = {}
    for name, folder in dirs.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder)
            if "results" in rel.parts:
                continue  # benchmarks/results holds records, not product code
            parts = [name, *rel.with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported product module, line) for every import in ``path``; ``from a import b`` counts as ``a.b`` when
    that is a module, else ``a``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import a.b.c` where only a.b is ours, or a third party
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target, node.lineno


GRAPH = {name: sorted(set(_imports(name, path))) for name, path in MODULES.items()}


def _frontend_names(name: str) -> tuple[str, ...]:
    """A tuple of names assigned in ``epdserve/frontend/__init__.py`` (``PUBLIC``, ``PROTOCOLS``), read with ast."""
    tree = ast.parse(MODULES["epdserve.frontend"].read_text())
    (value,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)]
    return tuple(ast.literal_eval(value))


FRONTEND = "epdserve.frontend"
PROTOCOLS = _frontend_names("PROTOCOLS")
PUBLIC = _frontend_names("PUBLIC")


def _protocol(module: str) -> str | None:
    """The front-end protocol package ``module`` belongs to (``openai``, ...), or None."""
    parts = module.split(".")
    return parts[2] if module.startswith(FRONTEND + ".") and parts[2] in PROTOCOLS else None


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def test_the_layout_sees_every_stage_and_the_shared_package():
    """Guards the checks below against passing on an empty graph (a moved folder, a renamed mapping)."""
    for expected in ("epdserve.engine.model_runner", "epdserve.wire.messages", "epdserve.entry.cli",
                     "epdserve.gateway.app", "epdserve.encoder.server", "epdserve.prefill.server",
                     "epdserve.decode.server", "epdserve.bench.cli"):
        assert expected in MODULES, expected
    assert sum(len(edges) for edges in GRAPH.values()) > 200


def test_no_import_cycle_between_product_modules():
    # Tarjan's strongly connected components, iteratively (no recursion limit on a long chain).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    for root in GRAPH:
        if root in index:
            continue
        work = [(root, iter(GRAPH[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target, _ in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(GRAPH[target])))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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
                        cycles.append(sorted(component))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_stages_import_only_shared_code():
    """A stage folder imports the shared package and proto, never another stage; the shared package imports no
    stage, except its entry points (the CLI starts every server) and the benchmarks that drive them."""
    wrong = []
    for module, edges in GRAPH.items():
        own = _stage(module)
        consumer = module.startswith(("epdserve.entry.", "epdserve.bench"))
        for target, line in edges:
            other = _stage(target)
            if other and other != own and not consumer:
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "\n".join(wrong)


def test_the_front_end_has_its_protocol_packages_and_public_core():
    """Guards the front-end checks below against passing on names that no longer exist."""
    for protocol in PROTOCOLS:
        assert f"{FRONTEND}.{protocol}" in MODULES, protocol
        assert any(_protocol(m) == protocol for m in MODULES if m != f"{FRONTEND}.{protocol}"), protocol
    for name in PUBLIC:
        assert f"{FRONTEND}.{name}" in MODULES and name not in PROTOCOLS, name


def test_protocol_packages_import_only_the_public_core_and_themselves():
    """A front-end protocol package (``epdserve/frontend/openai/``, ...) imports its own modules and the core's
    public modules (``PUBLIC`` in ``epdserve/frontend/__init__.py``), never another protocol package or the core's
    server-side modules; the core imports no protocol package. Composition (which protocols a server serves) is the
    servers': ``gateway/app.py``, ``epdserve/entry/front.py``."""
    public = {FRONTEND} | {f"{FRONTEND}.{name}" for name in PUBLIC}
    wrong = []
    for module, edges in GRAPH.items():
        if module != FRONTEND and not module.startswith(FRONTEND + "."):
            continue
        own = _protocol(module)
        for target, line in edges:
            if not target.startswith(FRONTEND):
                continue
            other = _protocol(target)
            if own is None and other is not None:
                why = "the core imports a protocol package"
            elif own is not None and other not in (None, own):
                why = "a protocol package imports another"
            elif own is not None and other is None and target not in public:
                why = "a protocol package imports a core module outside PUBLIC"
            else:
                continue
            wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target} ({why})")
    assert not wrong, "\n".join(wrong)


def test_every_package_folder_is_installed():
    """Each product folder with an ``__init__.py`` is a package pyproject.toml installs (a folder left out of
    ``packages`` is missing from a wheel, though an editable install still finds it)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert packages - listed == set(), sorted(packages - listed)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_files_and_functions_are_short(module):
    path = MODULES[module]
    if path.name.endswith(GENERATED):
        pytest.skip("generated by grpcio-tools")
    text = path.read_text()
    assert text.count("\n") <= MAX_FILE_LINES, f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.relative_to(ROOT)}: " + ", ".join(long)
