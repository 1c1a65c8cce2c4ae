"""An import-linter contract that no module of the project takes part in an import cycle.

import-linter's own contracts speak of packages (layers, independence, siblings); this one looks at
modules: a cycle of files (a.py imports b.py, which imports a.py, however far round) breaks it, wherever
the imports sit (at the top of a file or inside a function: import-linter reads both). Each cycle is
printed with the imports that close it, file and line, so the fix is where to look.
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
                    details = graph.get_import_details(importer=importer, imported=imported)
                    lines = sorted(detail["line_number"] for detail in details)
                    edges.append((importer, imported, lines))
            cycles.append({"modules": component, "imports": edges})
        return ContractCheck(kept=not cycles, metadata={"cycles": cycles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for cycle in check.metadata["cycles"]:
            output.print_error(f"{len(cycle['modules'])} modules import each other, round a cycle:")
            output.new_line()
            for importer, imported, lines in cycle["imports"]:
                where = ", ".join(f"l.{line}" for line in lines)
                output.print_error(f"-   {importer} -> {imported} ({where})", bold=False)
            output.new_line()
