#!/usr/bin/env python3
"""Import circles between the modules of packages/*/src (static: the import statements, wherever they stand).

    python tools/import_cycles.py            # from the project's root; exit 1 if any circle
    python tools/import_cycles.py --layers    # also: each layer imports only the layers below it (LAYERS)

Copied from the shared tools folder (../shared/tools/import_cycles.py) so that CI's lint session runs it;
the layers of megascale-core, lowest first: kernels <- model <- parallel <- plan / hf / fp8 / compose <- the
packages above (docs/guides/core.md, "Architecture").

A package's __init__.py that only re-exports is counted as the package: `from megascale.core.parallel.cp import X`
names cp/__init__.py, which names what it re-exports. Lazy imports inside functions count too: a circle that
only a deferred import hides is still a circle in the design."""
import ast, sys
from pathlib import Path

root = Path.cwd()
mods = {}
for f in sorted(root.glob("packages/*/src/megascale/**/*.py")):
    parts = f.relative_to(next(p for p in f.parents if p.name == "src")).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    mods[name] = f

def targets(name, f):
    pkg = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pkg import sub` names the submodule; `from pkg import name` names pkg (its face)
            cands = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for c in cands:
            while c and c not in mods:
                c = c.rsplit(".", 1)[0] if "." in c else ""
            if c and c != name:
                out.add(c)
    return out

graph = {n: targets(n, f) for n, f in mods.items()}
# strongly connected components (Tarjan)
index, low, stack, on, sccs, i = {}, {}, [], set(), [], [0]
def visit(v):
    index[v] = low[v] = i[0]; i[0] += 1; stack.append(v); on.add(v)
    for w in graph[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: sccs.append(sorted(comp))
sys.setrecursionlimit(10000)
for v in graph:
    if v not in index: visit(v)
bad = 0
for c in sccs:
    # a package importing its own submodules is how re-exports work; a circle needs a submodule importing back up
    bad += 1
    print(f"circle of {len(c)}: " + ", ".join(c))
    for a in c:
        for b in sorted(graph[a] & set(c)):
            print(f"    {a} -> {b}")
# (modules of a layer, what they must not import): each layer imports only downward
_ABOVE_MODEL = ("megascale.core.parallel", "megascale.core.fp8", "megascale.core.hf", "megascale.core.plan")
_PACKAGES_ABOVE_CORE = ("megascale.lightning", "megascale.data", "megascale.ft")
# parallel/compose.py (parallelize) stands on top of the dimensions, beside plan/hf/fp8: it applies fp8
ON_TOP = ("megascale.core.parallel.compose",)
LAYERS = [
    (("megascale.core.kernels",), ("megascale.core.model", *_ABOVE_MODEL)),
    (("megascale.core.model",), _ABOVE_MODEL),
    (("megascale.core.parallel",), ("megascale.core.fp8", "megascale.core.hf", "megascale.core.plan")),
    (("megascale.core",), _PACKAGES_ABOVE_CORE),
]
if "--layers" in sys.argv:
    for floor, above in LAYERS:
        for a, ts in sorted(graph.items()):
            if a in ON_TOP and floor == ("megascale.core.parallel",):
                continue
            if a == floor[0] or a.startswith(tuple(f + "." for f in floor)):
                for b in sorted(ts):
                    if b.startswith(above):
                        bad += 1; print(f"layer: {a} imports {b}")
print(f"{len(mods)} modules, {len(sccs)} circles" + (", layer check on" if "--layers" in sys.argv else ""))
sys.exit(1 if bad else 0)
