"""The shape of the code, read from the source: objects that each own one job (no class of the
project inherits from more than one project class), files that do one job (no module over
500 lines, no function over 60 lines; generated code aside)."""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOMS = ("client", "server", "common")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def _modules() -> dict[pathlib.Path, ast.Module]:
    return {
        path: ast.parse(path.read_text())
        for room in ROOMS
        for path in sorted((REPO / room).rglob("*.py"))
        if "_pb2" not in path.name
    }


def classes_with_several_project_bases(trees: dict[pathlib.Path, ast.Module]) -> list[str]:
    names = {node.name for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(base).split(".")[-1] for base in node.bases]
                if len([base for base in bases if base in names]) > 1:
                    found.append(f"{path.relative_to(REPO)}: {node.name}({', '.join(bases)})")
    return found


def test_no_class_inherits_from_more_than_one_project_class():
    assert classes_with_several_project_bases(_modules()) == []


def test_a_mixin_is_found():
    tree = ast.parse("class A: pass\nclass B: pass\nclass C(A, B): pass\nclass D(A, dict): pass\n")
    assert classes_with_several_project_bases({REPO / "x.py": tree}) == ["x.py: C(A, B)"]


def test_modules_and_functions_fit():
    long = []
    for path, tree in _modules().items():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(REPO)}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert long == []
