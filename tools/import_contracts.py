"""import-linter contracts of Klique's own (pyproject.toml's [tool.importlinter]; docs/architecture.md).

- `acyclic_modules`: no module takes part in an import cycle (a.py imports b.py, which imports a.py,
  however far round), wherever the imports sit (at the top of a file or inside a function: import-linter
  reads both).
- `acyclic_packages`: the same for the project's packages (each Django app, gateway/, tenants/, ...): no
  two of them import each other, however far round. A module belongs to the longest package listed
  that holds it, so a pure library inside an app (the scheduling engine) counts as a package of its own.
- `public_modules`: a package reaches another only through that one's public modules (models, services,
  selectors, ... and the few others listed, each with its reason), never its internals.

Each breach is printed with the imports behind it, file and line, so the fix is where to look.
"""

from __future__ import annotations

from typing import Any

from importlinter.application import output
from importlinter.domain import fields
from importlinter.domain.contract import Contract, ContractCheck


def _components(graph: Any, modules: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def imported(module: str) -> Any:
        return iter(sorted(graph.find_modules_directly_imported_by(module) & modules))

    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, imported(root))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child) & modules)))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
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
    return found


def _lines(graph: Any, importer: str, imported: str) -> list[int]:
    return sorted(
        detail["line_number"] for detail in graph.get_import_details(importer=importer, imported=imported)
    )


def _print(title: str, imports: list[tuple[str, str, list[int]]]) -> None:
    """A breach: what is wrong, then each import behind it with its lines."""
    output.print_error(title)
    output.new_line()
    for importer, imported, lines in imports:
        where = ", ".join(f"l.{line}" for line in lines)
        output.print_error(f"-   {importer} -> {imported} ({where})", bold=False)
    output.new_line()


class AcyclicModulesContract(Contract):
    """No import cycle among the modules of `containers` (all their descendants), leaving out modules whose
    name holds one of `skip` (Django's migrations)."""

    type_name = "acyclic_modules"

    containers = fields.ListField(subfield=fields.StringField())
    skip = fields.ListField(subfield=fields.StringField(), required=False)

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        skip = [str(part) for part in getattr(self, "skip", None) or []]
        containers = [str(container) for container in getattr(self, "containers", [])]
        modules = {
            module
            for container in containers
            for module in ({container} | graph.find_descendants(container))
            if not any(part in module for part in skip)
        }
        cycles = []
        for component in _components(graph, modules):
            members = set(component)
            edges = []
            for importer in component:
                for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
                    edges.append((importer, imported, _lines(graph, importer, imported)))
            cycles.append({"modules": component, "imports": edges})
        return ContractCheck(kept=not cycles, metadata={"cycles": cycles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for cycle in check.metadata["cycles"]:
            _print(f"{len(cycle['modules'])} modules import each other, round a cycle:", cycle["imports"])


def _owner(module: str, packages: list[str]) -> str | None:
    """The longest of `packages` that is `module` or holds it."""
    best = None
    for package in packages:
        if (module == package or module.startswith(package + ".")) and (
            best is None or len(package) > len(best)
        ):
            best = package
    return best


class _PackageGraph:
    """The imports between packages, each with the module imports behind it."""

    def __init__(self, graph: Any, packages: list[str], skip: list[str]) -> None:
        self.behind: dict[tuple[str, str], list[tuple[str, str]]] = {}
        for module in sorted(graph.modules):
            importer = _owner(module, packages)
            if importer is None or any(part in module for part in skip):
                continue
            for imported_module in sorted(graph.find_modules_directly_imported_by(module)):
                imported = _owner(imported_module, packages)
                if imported is not None and imported != importer:
                    self.behind.setdefault((importer, imported), []).append((module, imported_module))


class _Packages:
    """A graph-like view of _PackageGraph for `_components`."""

    def __init__(self, packages: _PackageGraph) -> None:
        self.packages = packages

    def find_modules_directly_imported_by(self, package: str) -> set[str]:
        return {imported for importer, imported in self.packages.behind if importer == package}


class AcyclicPackagesContract(Contract):
    """No import cycle among `packages` (a module counts for the longest one that holds it), leaving out
    modules whose name holds one of `skip`."""

    type_name = "acyclic_packages"

    packages = fields.ListField(subfield=fields.StringField())
    skip = fields.ListField(subfield=fields.StringField(), required=False)

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        packages = [str(package) for package in self.packages]  # type: ignore[attr-defined]
        skip = [str(part) for part in getattr(self, "skip", None) or []]
        between = _PackageGraph(graph, packages, skip)
        cycles = []
        for component in _components(_Packages(between), set(packages)):
            members = set(component)
            imports = [
                (module, imported, _lines(graph, module, imported))
                for (importer, target), behind in sorted(between.behind.items())
                if importer in members and target in members
                for module, imported in behind
            ]
            cycles.append({"packages": component, "imports": imports})
        return ContractCheck(kept=not cycles, metadata={"cycles": cycles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for cycle in check.metadata["cycles"]:
            _print(f"{', '.join(cycle['packages'])} import each other, round a cycle:", cycle["imports"])


class PublicModulesContract(Contract):
    """Between two of `packages`, an import names one of the imported package's public modules: a module
    whose first name inside the package is one of `public` (models, services, ...), a module listed in
    `also`, or anything of a package listed in `libraries` (pure code every package may use). Importers
    under `composers` (what wires everything together: urls, settings, commands) are not held."""

    type_name = "public_modules"

    packages = fields.ListField(subfield=fields.StringField())
    public = fields.ListField(subfield=fields.StringField())
    also = fields.ListField(subfield=fields.StringField(), required=False)
    libraries = fields.ListField(subfield=fields.StringField(), required=False)
    composers = fields.ListField(subfield=fields.StringField(), required=False)
    skip = fields.ListField(subfield=fields.StringField(), required=False)

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        packages = [str(package) for package in self.packages]  # type: ignore[attr-defined]
        public = {str(name) for name in self.public}  # type: ignore[attr-defined]
        also = {str(name) for name in getattr(self, "also", None) or []}
        libraries = {str(name) for name in getattr(self, "libraries", None) or []}
        composers = [str(name) for name in getattr(self, "composers", None) or []]
        skip = [str(part) for part in getattr(self, "skip", None) or []]
        between = _PackageGraph(graph, packages, skip)
        reached = []
        for (_, target), behind in sorted(between.behind.items()):
            if target in libraries:
                continue
            for module, imported in behind:
                if any(module == name or module.startswith(name + ".") for name in composers):
                    continue
                first = imported[len(target) + 1 :].split(".")[0]
                if first in public or any(
                    imported == name or imported.startswith(name + ".") for name in also
                ):
                    continue
                reached.append((module, imported, _lines(graph, module, imported)))
        return ContractCheck(kept=not reached, metadata={"reached": reached})

    def render_broken_contract(self, check: ContractCheck) -> None:
        _print("These imports reach into another package's internals:", check.metadata["reached"])
