"""What a script that launches workers must be: re-importable. `launch` calls `check_script` before
any process starts.

multiprocessing re-runs the caller's script in every worker (as "__mp_main__", skipping only its
`if __name__ == "__main__":` block) to find the functions defined there. So a script that launches
outside that block launches again in each worker, and a function defined inside the block does not
exist there: both kill the workers while they start, their error only on the terminal's stderr.
Here they are a one-line ValueError in the caller instead.
"""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path


def check_script(fn, main=None) -> None:
    """ValueError, before any process starts, if workers could not start from the caller's script.

    multiprocessing re-runs the caller's script in every worker (as "__mp_main__": only its
    `if __name__ == "__main__":` block is skipped) to find functions defined there. A script
    without that block launches again in each worker, and a function defined inside it does not
    exist there; both kill the workers while they start, their error only on the terminal.
    main: the `__main__` module (sys.modules'), a parameter so that tests can pass others.
    """
    main = sys.modules["__main__"] if main is None else main
    in_main = getattr(fn, "__module__", None) == "__main__"
    name = getattr(fn, "__qualname__", repr(fn)).split(".")[0]
    path, spec = getattr(main, "__file__", None), getattr(main, "__spec__", None)
    if path is None:  # a notebook, the REPL, python -c: nothing is re-run
        if in_main:
            raise ValueError(f"fn {name!r} is defined in a notebook or REPL; worker processes can "
                             "only import functions from a module: move it into a .py file")
        return
    if spec is not None and spec.name.split(".")[-1] == "__main__":  # python -m package
        if in_main:  # multiprocessing does not run a package's __main__ again: fn is not there
            raise ValueError(f"fn {name!r} is defined in {spec.name}, which workers do not "
                             "import: define it in another module of the package")
        return
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):  # not Python source (a zip app, say)
        return
    script = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    guards = [node for node in tree.body if _is_main_guard(node)]
    if not guards:
        raise ValueError(f"{script} has no `if __name__ == \"__main__\":` block: worker "
                         f"processes re-import {script}; put the code that launches under "
                         "`if __name__ == \"__main__\":`")
    line = next((f.f_lineno for f in _frames() if f.f_code.co_name == "<module>"
                 and os.path.abspath(f.f_code.co_filename) == os.path.abspath(path)), None)
    if line and not any(g.body[0].lineno <= line <= g.body[-1].end_lineno for g in guards):
        raise ValueError(f"{script} launches at line {line}, outside `if __name__ == \"__main__\":`"
                         f"; worker processes re-import {script} and would launch again: move it "
                         "under the guard")
    outside = _names_bound(tree.body)
    inside = set().union(*(_names_bound(guard.body) for guard in guards))
    if in_main and name in inside - outside and "*" not in outside:
        raise ValueError(f"fn {name!r} is defined inside `if __name__ == \"__main__\":` of "
                         f"{script}; workers re-import the script without running that block: "
                         "define it at the top level (or in a module)")


def _frames():
    """The calls that led here, innermost first (the script's top-level frame among them)."""
    frame = sys._getframe(1)
    while frame is not None:
        yield frame
        frame = frame.f_back


def _is_main_guard(node) -> bool:
    """Whether a statement is `if __name__ == "__main__":` (either way round)."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and len(node.test.ops) == 1 and isinstance(node.test.ops[0], ast.Eq)):
        return False
    sides = [node.test.left, *node.test.comparators]
    return (any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
            and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))


def _names_bound(body: list) -> set[str]:
    """The names these statements bind when a worker runs them as "__mp_main__": everything they
    define, import or assign, but not in a `__main__` guard's body (its else branch does run).
    Over-counts (names inside functions) rather than miss one."""
    names = set()
    for node in body:
        if _is_main_guard(node):
            names |= _names_bound(node.orelse)
            continue
        for n in ast.walk(node):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in n.names}
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
    return names
