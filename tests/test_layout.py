"""The structure of kvindex and adapters, checked from their source (issue 12's targets).

Pure AST, no kvindex module is imported (only the importtime check starts a process):
- import direction: a module imports (at module level, inside functions, under TYPE_CHECKING, or
  with ``importlib.import_module("...")``) only from its own layer or lower ones, per ``LAYERS``;
  adapters import only the vocabulary; nothing outside ``kvindex.tools`` imports it, except the
  CLI's subcommands, inside their functions;
- the longest chain of imports among these modules (every import counted, importing ``a.b``
  importing package ``a`` first, as Python does) is at most ``MAX_CHAIN`` modules;
- no module is over ``MAX_LINES`` lines;
- no module touches another module's private (``_underscore``) names: ``from m import _x``,
  ``m._x`` on an imported module, or a ``_private`` module imported from outside its package;
- ``kvindex serve`` loads nothing from ``kvindex.tools`` (``python -X importtime``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvindex", "adapters")
MAX_LINES = 400
MAX_CHAIN = 9

# The agreed layers, lowest first. A module may import from its own layer or a lower one, never a
# higher one. An entry is a module or a package (then every module under it); the longest entry
# that contains a module decides its layer ("kvindex" is only the package's __init__).
LAYERS: dict[int, tuple[str, ...]] = {
    0: ("kvindex", "kvindex.config", "kvindex.configfile", "kvindex.events", "kvindex.keys", "kvindex.native", "kvindex.logs",
        "kvindex.loops", "kvindex.sequence", "kvindex.tokenize", "kvindex.metrics", "kvindex.settings",
        "kvindex.storeurl", "kvindex.strict", "kvindex.views", "kvindex.types", "kvindex.budget",
        "kvindex.limits", "kvindex.lora",
        "kvindex._keys", "kvindex._jsontokens"),  # vocabulary
    1: ("adapters",),  # engine dialect decoders and tokenizers (adapters._vllm is their C twin)
    2: ("kvindex.approx",),  # request -> prompt string -> hashes
    3: ("kvindex.index",),  # the index contracts and backends
    4: ("kvindex.ingest",),  # transport, lanes, fleet
    5: ("kvindex.query", "kvindex.pods",
        "kvindex.registrations", "kvindex.dynamo_dump"),
    6: ("kvindex.persist",),
    7: ("kvindex.http", "kvindex.http.fields", "kvindex.http.mooncake",  # (mooncake: the RFC's other dialect)
        "kvindex.route",  # the front doors: HTTP, the request path (Envoy ext_proc over gRPC),
        "kvindex.sglang"),  # and SGLang's KV indexer API (gRPC, over kvindex.route's server)
    8: ("kvindex.shard",),
    9: ("kvindex.daemon", "kvindex.cli", "kvindex.tool_args", "kvindex.__main__"),  # the composition root, the CLI
    10: ("kvindex.tools",),  # demo, simulator, workload, recorder: may use anything, used by no core module
}
VOCABULARY = 0
TOOLS = "kvindex.tools"
# the only core modules that may import kvindex.tools, and only inside functions (their subcommands)
TOOLS_LAZY_IMPORTERS = {"kvindex.cli"}
# native accelerators, loaded through kvindex.native: private modules anyone may name
NATIVE = {"kvindex._keys", "kvindex._jsontokens", "kvindex.index._core", "adapters._vllm"}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # one of our modules
    line: int
    lazy: bool  # inside a function
    implicit: bool = False  # a parent package of the module named (Python imports it first)

    def __str__(self) -> str:
        return f"{path_of(self.importer)}:{self.line}: {self.importer} imports {self.target}" + \
            (" (inside a function)" if self.lazy else "")


@cache
def modules() -> dict[str, Path]:
    """Every Python module of the packages by dotted name (a package by its name)."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def known() -> set[str]:
    return set(modules()) | NATIVE


def path_of(module: str) -> str:
    path = modules().get(module)
    return str(path.relative_to(ROOT)) if path else module


def layer_of(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (length of the entry, layer)
    for layer, entries in LAYERS.items():
        for entry in entries:
            if module == entry or (module.startswith(entry + ".") and entry not in PACKAGES[:1]):
                if best is None or len(entry) > best[0]:
                    best = (len(entry), layer)
    return best[1] if best else None


@cache
def tree(module: str) -> ast.Module:
    return ast.parse(modules()[module].read_text(), filename=str(modules()[module]))


def _package_of(module: str) -> str:
    """The package a module's relative imports start from."""
    return module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]


def _absolute(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module).split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_lines(module: str) -> set[int]:
    """Line numbers of import statements inside a function."""
    lines: set[int] = set()
    for fn in ast.walk(tree(module)):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            lines |= {n.lineno for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom | ast.Call)}
    return lines


def imports_of(module: str) -> Iterator[tuple[ast.AST, str, str | None]]:
    """(node, imported module, imported name or None) for every import statement and every
    ``import_module("...")``/``__import__("...")`` with a constant name, wherever it is."""
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            for alias in node.names:
                yield node, source, alias.name
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("import_module", "__import__"):
                yield node, node.args[0].value, None


@cache
def edges() -> tuple[Import, ...]:
    """Every import of one of our modules by one of our modules (importing ``a.b.c`` imports the
    packages ``a`` and ``a.b`` first: those count too)."""
    ours = known()
    out: list[Import] = []
    for module in modules():
        lazy = _lazy_lines(module)
        for node, source, name in imports_of(module):
            target = f"{source}.{name}" if name and f"{source}.{name}" in ours else source
            if target.split(".")[0] not in PACKAGES or target not in ours:
                continue
            line = getattr(node, "lineno", 0)
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                step = ".".join(parts[:i])
                if step in ours and step != module:
                    out.append(Import(module, step, line, line in lazy, implicit=step != target))
    return tuple(out)


# -- import direction ---------------------------------------------------------------------------
def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in known() if layer_of(m) is None)
    assert not missing, f"modules in no layer of LAYERS (add them to the table in {__file__}): {missing}"


def test_every_layer_entry_names_a_module() -> None:
    stale = sorted(e for entries in LAYERS.values() for e in entries
                   if not any(m == e or m.startswith(e + ".") for m in known()))
    assert not stale, f"entries of LAYERS that name no module (renamed? update the table): {stale}"


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for imp in edges():
        a, b = layer_of(imp.importer), layer_of(imp.target)
        if imp.implicit or a is None or b is None or b <= a:
            continue
        if b == 10 and imp.importer in TOOLS_LAZY_IMPORTERS and imp.lazy:
            continue  # a CLI subcommand loads its tool when it runs (checked by the tools test too)
        wrong.append(f"{imp}: layer {a} imports layer {b}")
    assert not wrong, "imports pointing up the layers:\n" + "\n".join(dict.fromkeys(wrong))


def test_adapters_import_only_the_vocabulary() -> None:
    wrong = [f"{imp}: layer {layer_of(imp.target)}" for imp in edges()
             if not imp.implicit and imp.importer.split(".")[0] == "adapters" and imp.target.split(".")[0] == "kvindex"
             and layer_of(imp.target) != VOCABULARY]
    assert not wrong, "adapters import beyond the vocabulary:\n" + "\n".join(dict.fromkeys(wrong))


def test_core_never_imports_tools() -> None:
    wrong = [str(imp) for imp in edges()
             if not imp.implicit and (imp.target == TOOLS or imp.target.startswith(TOOLS + "."))
             and not (imp.importer == TOOLS or imp.importer.startswith(TOOLS + "."))
             and not (imp.importer in TOOLS_LAZY_IMPORTERS and imp.lazy)]
    assert not wrong, ("core modules importing kvindex.tools (only the CLI's subcommands may, inside "
                       "their functions):\n" + "\n".join(dict.fromkeys(wrong)))


# -- size ---------------------------------------------------------------------------------------
def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in known()}
    for imp in edges():
        graph[imp.importer].add(imp.target)
    return graph


def in_cycles(graph: dict[str, set[str]]) -> set[str]:
    """The modules on some cycle of imports (strongly connected components of more than one)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cyclic: set[str] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cyclic.update(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cyclic


def longest_chain() -> list[str]:
    """The longest chain m1 -> m2 -> ... of imports with no module twice. From a module on no
    cycle, the longest chain does not depend on how it was reached (nothing after it leads back):
    memoised; around cycles, every simple path is tried."""
    graph = import_graph()
    named: dict[str, set[str]] = {m: set() for m in graph}
    for imp in edges():
        if not imp.implicit:
            named[imp.importer].add(imp.target)
    cyclic = in_cycles(graph)
    memo: dict[str, list[str]] = {}

    def walk(node: str, on_path: set[str]) -> list[str]:
        if node in memo:
            return memo[node]
        longest = [node]
        for nxt in sorted(graph[node], key=lambda m: (m not in named[node], m)):  # named imports first
            if nxt in on_path:
                continue
            on_path.add(nxt)
            tail = walk(nxt, on_path)
            on_path.discard(nxt)
            if 1 + len(tail) > len(longest):
                longest = [node] + tail
        if node not in cyclic:
            memo[node] = longest
        return longest

    return max((walk(m, {m}) for m in sorted(graph)), key=len)


def test_longest_import_chain() -> None:
    chain = longest_chain()
    cycles = sorted(in_cycles(import_graph()))
    assert len(chain) <= MAX_CHAIN, (f"the longest import chain is {len(chain)} modules (at most {MAX_CHAIN}):\n  "
                                     + "\n  -> ".join(chain) + (f"\nmodules on import cycles: {cycles}" if cycles else ""))


def test_no_module_over_the_line_limit() -> None:
    sizes = {m: len(p.read_text().splitlines()) for m, p in modules().items()}
    over = sorted(((n, m) for m, n in sizes.items() if n > MAX_LINES), reverse=True)
    assert not over, f"modules over {MAX_LINES} lines:\n" + "\n".join(f"  {n:5d} {path_of(m)}" for n, m in over)


# -- privacy ------------------------------------------------------------------------------------
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _outside(importer: str, module: str) -> bool:
    """Whether ``importer`` is outside the package that holds the private module ``module``."""
    parent = module.rpartition(".")[0]
    return not (importer == parent or importer.startswith(parent + "."))


def test_no_module_touches_another_modules_private_names() -> None:
    ours = known()
    wrong = []
    for module in modules():
        imported: dict[str, str] = {}  # local name -> our module it is bound to
        for node, source, name in imports_of(module):
            line = getattr(node, "lineno", 0)
            where = f"{path_of(module)}:{line}"
            if source.split(".")[0] not in PACKAGES:
                continue
            target = f"{source}.{name}" if name and f"{source}.{name}" in ours else source
            if name is not None and _private(name) and target == source:
                wrong.append(f"{where}: from {source} import {name}")
            private_parts = [i for i, part in enumerate(target.split(".")) if _private(part)]
            if private_parts and target not in NATIVE:
                holder = ".".join(target.split(".")[:private_parts[0] + 1])
                if _outside(module, holder):
                    wrong.append(f"{where}: imports the private module {holder}")
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        imported[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if target != source:  # a module imported by name
                        imported[alias.asname or alias.name] = target
        for node in ast.walk(tree(module)):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                base = node.value
                dotted: list[str] = []
                while isinstance(base, ast.Attribute):
                    dotted.insert(0, base.attr)
                    base = base.value
                if not isinstance(base, ast.Name):
                    continue
                if base.id in imported:
                    owner = ".".join([imported[base.id], *dotted])
                elif base.id in PACKAGES:  # import kvindex.x.y binds kvindex
                    owner = ".".join([base.id, *dotted])
                else:
                    continue
                if owner in ours and owner != module and f"{owner}.{node.attr}" not in NATIVE:
                    wrong.append(f"{path_of(module)}:{node.lineno}: {owner}.{node.attr}")
    assert not wrong, "modules touching another module's private names:\n" + "\n".join(sorted(set(wrong)))


# -- what kvindex serve loads -------------------------------------------------------------------
def test_serve_loads_nothing_from_tools() -> None:
    code = ("import sys, kvindex.cli, kvindex.daemon\n"
            "sys.argv = ['kvindex', 'serve', '--help']\n"
            "kvindex.cli.main()\n")
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
              if line.startswith("import time:") and line.count("|") == 2]
    assert "kvindex.daemon" in loaded and "kvindex.cli" in loaded, proc.stderr[-2000:]
    tools = [m for m in loaded if m == TOOLS or m.startswith(TOOLS + ".")]
    assert not tools, f"kvindex serve imports {tools}"
