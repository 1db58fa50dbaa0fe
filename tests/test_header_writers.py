"""One writer per header word, in one file each: only ``common/trainer_header.py`` (the
trainer's words) and ``common/server_header.py`` (the server's) store into a segment header.

Read from the source: any assignment to ``<x>[Word.<W>]`` and any call of the header's store
methods (``set_cow_epoch``, ``set_cow_slot``, ``set_slot_taken``, ``set_slot_freed``)
elsewhere in the product's code fails this test. Tests may still poke words (to play a dead
trainer, say); the product may not.
"""

from __future__ import annotations

import ast
import pathlib

from swap_state.common.segment import Word

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOMS = ("client", "server", "common")
WRITERS = {"common/trainer_header.py", "common/server_header.py", "common/segment.py"}
STORE_METHODS = {"set_cow_epoch", "set_cow_slot", "set_slot_taken", "set_slot_freed"}


def header_stores(source: str) -> list[tuple[int, str]]:
    """(line, what) of every header store in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign):
            targets = [node.target]
        for target in targets:
            if (
                isinstance(target, ast.Subscript)
                and isinstance(target.slice, ast.Attribute)
                and isinstance(target.slice.value, ast.Name)
                and target.slice.value.id == "Word"
            ):
                found.append((node.lineno, f"stores Word.{target.slice.attr}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in STORE_METHODS:
            found.append((node.lineno, f"calls {node.func.attr}"))
    return found


def test_only_the_two_header_classes_store_into_the_header():
    offenders = []
    for room in ROOMS:
        for path in sorted((REPO / room).rglob("*.py")):
            relative = path.relative_to(REPO).as_posix()
            if relative in WRITERS:
                continue
            offenders += [f"{relative}:{line}: {what}" for line, what in header_stores(path.read_text())]
    assert offenders == []


def test_a_store_elsewhere_is_found():
    source = "def f(h):\n    h[Word.MODEL_STEP] = 3\n    h.header[Word.BP_WAITS] += 1\n    h.set_slot_freed(0, 1)\n"
    assert header_stores(source) == [(2, "stores Word.MODEL_STEP"), (3, "stores Word.BP_WAITS"), (4, "calls set_slot_freed")]


def test_each_trainer_word_is_stored_in_the_trainer_header_only():
    """The trainer's words (``# trainer:`` in the Word table) are stored by TrainerHeader, the
    server's by ServerHeader: no word has two writers."""
    segment = (REPO / "common/segment.py").read_text()
    owner = {}
    body = segment.split("class Word", 1)[1].splitlines()[1:]
    for line in body:
        if line and not line.startswith("    "):
            break  # the end of the class
        if "=" in line and "#" in line:
            name = line.split("=")[0].strip()
            owner[name] = "trainer" if line.split("#", 1)[1].strip().startswith("trainer") else "server"
    stored = {
        "trainer": {w.split(".")[1] for _, w in header_stores((REPO / "common/trainer_header.py").read_text()) if "Word." in w},
        "server": {w.split(".")[1] for _, w in header_stores((REPO / "common/server_header.py").read_text()) if "Word." in w},
    }
    assert len(owner) == len(Word)
    for side, words in stored.items():
        assert words and {w for w in words if owner[w] != side} == set(), side
