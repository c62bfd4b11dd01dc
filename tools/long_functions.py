"""List the library functions longer than a limit (default 60 lines, ``def`` line to last line).

Reads ``worldfoundry/`` and ``plugins/*/src`` as text with :mod:`ast` (nothing is imported). Exit status 1 when
any function is over the limit, so it can run in CI.

Usage::

    python tools/long_functions.py            # limit 60
    python tools/long_functions.py 50
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def long_functions(limit: int, root: Path = ROOT) -> Iterator[tuple[int, str, str]]:
    """``(lines, "path:line", qualified name)`` of every function longer than ``limit`` lines."""
    for base in [root / "worldfoundry", *sorted((root / "plugins").glob("*/src"))]:
        for path in sorted(base.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            stack: list[tuple[ast.AST, str]] = [(tree, "")]
            while stack:
                node, prefix = stack.pop()
                for child in ast.iter_child_nodes(node):
                    if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        name = f"{prefix}{child.name}"
                        lines = child.end_lineno - child.lineno + 1
                        if not isinstance(child, ast.ClassDef) and lines > limit:
                            yield lines, f"{path.relative_to(root)}:{child.lineno}", name
                        stack.append((child, name + "."))
                    else:
                        stack.append((child, prefix))


def main(argv: list[str]) -> int:
    limit = int(argv[0]) if argv else 60
    rows = sorted(long_functions(limit), reverse=True)
    for lines, where, name in rows:
        print(f"{lines:4d} {where} {name}")
    print(f"{len(rows)} functions over {limit} lines")
    return 1 if rows else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
