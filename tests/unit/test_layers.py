"""The packages' import arrows (docs/internals.md, "Layers"), read from the source with `ast`.

Every module of `specwire/` is parsed (nothing is imported), its imports resolved to our modules or
to third-party names, and each rule of `RULES` checked. A failure names the importing module, the line
and the import, and for a rule about what a package *reaches*, the chain of imports that reaches it.

Imports inside functions count (they are arrows too: a lazy import of another service is still a
dependency on it), except for the rule that is about import time: what `import specwire.client...`
executes, i.e. module-level imports (class bodies included, `if TYPE_CHECKING:` blocks excluded) and
the package `__init__`s Python runs on the way.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SERVICES = ("specwire.config_service", "specwire.draft_service", "specwire.target_service")
CLIENT = ("specwire.client",)
# Generated messages and stubs of protos/ (`specwire.config` is the proto package, not config_service).
GENERATED = ("specwire.common", "specwire.config", "specwire.draft", "specwire.target")
CORE = ("specwire.generation", "specwire.runtime", "specwire.models")
GRPC_AND_PROTOBUF = ("grpc", "grpc_health", "grpc_reflection", "grpc_status", "google.protobuf", "google.rpc")
# Our modules that are gRPC plumbing (they import grpc themselves).
SERVER_PLUMBING = ("specwire.serving", "specwire.security", "specwire.rpc_limits", "specwire.telemetry")
# The bottom: every layer may import these; they import nothing of ours but BASE.
BASE = ("specwire.errors", "specwire.vocabulary")
# Shared utilities: deadlines, thread pools, the model thread, ports, folders, the heap setting.
UTILITIES = (
    "specwire.deadline",
    "specwire.pools",
    "specwire.model_thread",
    "specwire.ports",
    "specwire.paths",
    "specwire.heap",
)
# What a service may import of specwire besides its own package.
SERVICE_MAY_IMPORT = (
    *GENERATED,
    *SERVER_PLUMBING,
    "specwire.wire",
    "specwire.generation",
    "specwire.models",
    "specwire.runtime",
    *BASE,
    *UTILITIES,
)
# What the wire conversions may import of specwire: the messages they convert and the domain types.
WIRE_MAY_IMPORT = ("specwire.wire", *GENERATED, "specwire.generation", *BASE)
# The data types of the core that the client hands to its callers (a config, transition scores).
# Everything else in the core (loops, processors, KV runtime, model loading) must not load when a
# client module is imported.
CLIENT_MAY_LOAD_OF_CORE = (
    "specwire.generation.config",
    "specwire.generation.outputs",
    "specwire.generation.argument_errors",
)


def within(module: str, packages: Iterable[str]) -> bool:
    """Whether `module` is one of `packages` or inside one."""
    return any(module == p or module.startswith(p + ".") for p in packages)


def is_stub(module: str) -> bool:
    return module.rsplit(".", 1)[-1].endswith(("_pb2", "_pb2_grpc"))


@dataclass(frozen=True)
class Import:
    """One import statement's target, as seen from `importer`."""

    importer: str
    target: str  # our module (resolved), or the third-party dotted name as written
    line: int
    at_import_time: bool


@dataclass(frozen=True)
class Rule:
    """`importers` must not import (or, if `transitive`, reach) a module for which `forbidden` is true.

    Args:
        text (`str`): the rule as docs/internals.md states it.
        importers (`tuple[str, ...]`): the packages or modules it applies to.
        forbidden (`Callable[[str, str], bool]`): `(importer, target) -> True` when the arrow is not allowed.
        transitive (`str`, defaults to `""`): `""` checks direct imports; `"import time"` checks every
            module a module-level import reaches; `"any"` every module any import reaches.
    """

    text: str
    importers: tuple[str, ...]
    forbidden: Callable[[str, str], bool]
    transitive: str = ""


def _top(module: str) -> str:
    """`specwire.x` for `specwire.x.y.z` (the package a module belongs to), else the module's first name."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "specwire" else parts[0]


RULES = [
    Rule(
        "a service imports no other service (each has its own process and deployment)",
        SERVICES,
        lambda importer, target: within(target, SERVICES) and _top(target) != _top(importer),
    ),
    Rule(
        "a service imports of specwire only its own package, the generated stubs, serving/security/"
        "telemetry, wire, generation, models, runtime, errors, vocabulary and the shared utilities "
        "(never the client)",
        SERVICES,
        lambda importer, target: (
            within(target, ("specwire",))
            and _top(target) != _top(importer)
            and target != "specwire"
            and not within(target, SERVICE_MAY_IMPORT)
        ),
    ),
    Rule("the client imports no service", CLIENT, lambda importer, target: within(target, SERVICES)),
    Rule(
        "importing the client loads no torch-heavy core: of specwire.generation only its data types "
        f"({', '.join(CLIENT_MAY_LOAD_OF_CORE)}), no models, runtime, model thread or transformers",
        CLIENT,
        lambda importer, target: (
            (
                within(target, CORE)
                and target not in ("specwire.generation",)
                and not within(target, CLIENT_MAY_LOAD_OF_CORE)
            )
            or within(target, ("specwire.model_thread", "transformers"))
        ),
        transitive="import time",
    ),
    Rule(
        "the core (generation, runtime, models) reaches no gRPC or protobuf, no generated stubs, no server "
        "plumbing, no wire, no service and no client",
        CORE,
        lambda importer, target: (
            within(target, (*GRPC_AND_PROTOBUF, *GENERATED, *SERVER_PLUMBING, "specwire.wire", *SERVICES, *CLIENT))
            or is_stub(target)
        ),
        transitive="any",
    ),
    Rule(
        "the pure core (generation) imports neither model loading (models) nor the KV runtime (runtime), "
        "which build on it",
        ("specwire.generation",),
        lambda importer, target: within(target, ("specwire.models", "specwire.runtime")),
    ),
    Rule(
        "wire imports of specwire only the generated stubs, generation and errors/vocabulary (no service, "
        "no client, no server plumbing: serving imports wire)",
        ("specwire.wire",),
        lambda importer, target: within(target, ("specwire",)) and not within(target, WIRE_MAY_IMPORT),
    ),
    Rule(
        "the server plumbing (serving, security, telemetry, rpc_limits) imports no service, no client and no core",
        SERVER_PLUMBING,
        lambda importer, target: within(target, (*SERVICES, *CLIENT, *CORE)),
    ),
    Rule(
        "errors and vocabulary import nothing of specwire (every layer imports them)",
        BASE,
        lambda importer, target: within(target, ("specwire",)),
    ),
    Rule(
        "the shared utilities import nothing of specwire but errors and vocabulary",
        UTILITIES,
        lambda importer, target: within(target, ("specwire",)) and not within(target, BASE),
    ),
    Rule(
        "nothing in specwire imports the tests, the benchmarks, or the legacy-name finder (the .pth loads it)",
        ("specwire",),
        lambda importer, target: within(target, ("tests", "bench", "specwire.legacy_imports")),
    ),
]


# ---------------------------------------------------------------------------------------------------
# Reading the imports
# ---------------------------------------------------------------------------------------------------


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules(root: Path = ROOT) -> dict[str, ast.Module]:
    """Every module of specwire/ but the generated stubs, parsed."""
    modules = {}
    for path in sorted((root / "specwire").rglob("*.py")):
        name = module_name(path, root)
        if within(name, GENERATED) and path.name != "__init__.py":
            continue
        modules[name] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportReader(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: set[str]):
        self.module, self.is_package, self.known = module, is_package, known
        self.at_import_time = True
        self.found: list[Import] = []

    def _nested(self, nodes: Iterable[ast.AST], at_import_time: bool) -> None:
        saved, self.at_import_time = self.at_import_time, self.at_import_time and at_import_time
        for node in nodes:
            self.visit(node)
        self.at_import_time = saved

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self._nested(ast.iter_child_nodes(node), at_import_time=False)

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        self.visit(node.test)
        self._nested(node.body, at_import_time=not _is_type_checking(node.test))
        self._nested(node.orelse, at_import_time=True)

    def _add(self, target: str, node: ast.stmt) -> None:
        self.found.append(Import(self.module, target, node.lineno, self.at_import_time))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            package = self.module if self.is_package else self.module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        if base == "__future__":
            return
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            # `from package import module` imports the module; `from module import name` the module.
            self._add(submodule if submodule in self.known else base, node)


def read_imports(modules: dict[str, ast.Module], packages: set[str] | None = None) -> list[Import]:
    """The imports of every module (`packages`: which names are packages; default: those with an
    `__init__`, guessed here as the names that are a prefix of another module)."""
    known = set(modules)
    if packages is None:
        packages = {m for m in known if any(other.startswith(m + ".") for other in known)}
    found: list[Import] = []
    for name, tree in modules.items():
        reader = _ImportReader(name, name in packages, known)
        reader.visit(tree)
        found.extend(reader.found)
    return found


def _parents(module: str, known: set[str]) -> Iterator[str]:
    """The packages Python runs before `module` (their `__init__`s), outermost first."""
    parts = module.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent in known:
            yield parent


def _reach(start: str, edges: dict[str, list[Import]], known: set[str], import_time: bool) -> dict[str, list[Import]]:
    """Every module reachable from `start` -> the chain of imports that first reaches it."""
    chains: dict[str, list[Import]] = {start: []}
    todo = [start]
    while todo:
        current = todo.pop(0)
        steps = [Import(current, p, 0, True) for p in _parents(current, known)]
        steps += [i for i in edges.get(current, []) if i.at_import_time or not import_time]
        for step in steps:
            targets = [step.target, *_parents(step.target, known)]
            for target in targets:
                if target not in chains:
                    chains[target] = [*chains[current], step]
                    if target in known:
                        todo.append(target)
    return chains


def violations(modules: dict[str, ast.Module], rules: list[Rule] = RULES) -> list[str]:
    """Every broken rule, one line each: the rule, the module, the line and the import (with its chain)."""
    imports = read_imports(modules)
    known = set(modules)
    edges: dict[str, list[Import]] = {}
    for i in imports:
        edges.setdefault(i.importer, []).append(i)
    found = []
    for rule in rules:
        for module in sorted(m for m in known if within(m, rule.importers)):
            if not rule.transitive:
                for i in edges.get(module, []):
                    if rule.forbidden(module, i.target):
                        found.append(f"{rule.text}:\n    {module}:{i.line} imports {i.target}")
                continue
            chains = _reach(module, edges, known, import_time=rule.transitive == "import time")
            for target, chain in sorted(chains.items()):
                if chain and rule.forbidden(module, target):
                    path = " -> ".join(f"{step.importer}:{step.line}" if step.line else step.importer for step in chain)
                    found.append(f"{rule.text}:\n    {module} reaches {target} ({path} -> {target})")
    return found


# ---------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------


def test_imports_follow_the_layers():
    broken = violations(source_modules())
    assert not broken, "imports against the layers (docs/internals.md, 'Layers'):\n" + "\n".join(broken)


def test_the_reader_sees_the_arrows_that_exist():
    """Not vacuous: known arrows of today's code are read, with the right import-time flag."""
    imports = read_imports(source_modules())
    arrows = {(i.importer, i.target): i.at_import_time for i in imports}
    assert arrows[("specwire.target_service.service", "specwire.serving")] is True
    assert arrows[("specwire.client.target_client", "specwire.wire.tensors")] is True
    assert arrows[("specwire.client.cli", "specwire.telemetry")] is False  # inside main()
    assert arrows[("specwire.generation.processors", "specwire.generation.processors.base")] is True  # relative
    assert len(imports) > 200


def _parsed(sources: dict[str, str]) -> dict[str, ast.Module]:
    return {name: ast.parse(text) for name, text in sources.items()}


FAKE_PACKAGES = {
    "specwire": "",
    "specwire.generation": "",
    "specwire.client": "",
    "specwire.target_service": "",
    "specwire.draft_service": "",
    "specwire.serving": "import grpc\n",
    "specwire.errors": "",
}


def test_a_service_importing_another_service_is_named():
    broken = violations(
        _parsed({**FAKE_PACKAGES, "specwire.target_service.x": "def f():\n    import specwire.draft_service\n"})
    )
    assert any("specwire.target_service.x:2 imports specwire.draft_service" in b for b in broken), broken


def test_a_core_module_reaching_grpc_is_named_with_its_chain():
    sources = {
        **FAKE_PACKAGES,
        "specwire.generation.loop": "from specwire.errors import X\nfrom specwire import serving\n",
    }
    broken = violations(_parsed(sources))
    assert any("specwire.generation.loop reaches grpc" in b and "specwire.serving" in b for b in broken), broken


def test_the_client_may_import_the_core_lazily_but_not_at_import_time():
    lazy = {
        **FAKE_PACKAGES,
        "specwire.generation.decoding": "",
        "specwire.client.x": "def f():\n    from specwire.generation import decoding\n",
    }
    assert violations(_parsed(lazy)) == []
    eager = {**lazy, "specwire.client.x": "from specwire.generation.decoding import loop\n"}
    broken = violations(_parsed(eager))
    assert any("specwire.client.x reaches specwire.generation.decoding" in b for b in broken), broken
    # through a package __init__ that imports the loops
    init = {
        **lazy,
        "specwire.generation": "from . import decoding\n",
        "specwire.generation.config": "",
        "specwire.client.x": "from specwire.generation.config import GenerationConfig\n",
    }
    broken = violations(_parsed(init))
    assert any("reaches specwire.generation.decoding" in b for b in broken), broken
