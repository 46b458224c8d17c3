"""Size stays honest (STYLE.md): every module readable in one sitting, lines readable beside a notebook,
functions short enough to follow, and an import graph that tells the truth."""
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted([*(ROOT / "minipar").rglob("*.py"), *(ROOT / "bench").rglob("*.py")])
PACKAGE = sorted((ROOT / "minipar").rglob("*.py"))
LONG_FUNCTION = 60  # lines; a longer one says why in a comment that starts "# long:"


def test_modules_are_short_and_lines_readable():
    for path in SOURCES:
        lines = path.read_text().splitlines()
        name = path.relative_to(ROOT)
        assert len(lines) <= 400, f"{name} has {len(lines)} lines: split it"
        long = [i + 1 for i, line in enumerate(lines) if len(line) > 100]
        assert not long, f"{name}: lines {long} are over 100 characters"


def test_functions_are_short_or_say_why():
    for path in SOURCES:
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = lines[node.lineno - 1:node.end_lineno]
                if len(body) > LONG_FUNCTION:
                    assert any(line.strip().startswith("# long:") for line in body), (
                        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} has {len(body)} lines: "
                        f"split it, or say why not in a '# long: ...' comment")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_import_graph_has_no_circle():
    """Every import of a minipar module, at the top or inside a function, is an edge; the package's own
    __init__ files only re-export, so an import of a package counts as one of the modules it names."""
    modules = {_module(p): p for p in PACKAGE}
    edges = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minipar"):
                targets = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in targets if t in modules] or [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("minipar")]
            else:
                continue
            edges[name] |= {t for t in targets if t in modules and not modules[t].name == "__init__.py"}
    state, path = {}, []

    def visit(m):
        state[m] = "open"
        path.append(m)
        for t in edges[m]:
            assert state.get(t) != "open", f"import circle: {' -> '.join(path[path.index(t):] + [t])}"
            if t not in state:
                visit(t)
        path.pop()
        state[m] = "done"

    for m in modules:
        if m not in state:
            visit(m)


def test_no_module_level_state():
    """No module keeps mutable state (DESIGN: the topology is a value): no empty containers or
    thread-locals filled at run time, no `global`."""
    for path in PACKAGE:
        name = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = ast.unparse(node.value)
                for t in targets:
                    assert not re.fullmatch(r"\[\]|\{\}|\[0\]|set\(\)|dict\(\)|list\(\)|"
                                            r"threading\.local\(\)", value), \
                        f"{name}: module-level state {ast.unparse(t)} = {value}"
        assert not any(isinstance(n, ast.Global) for n in ast.walk(tree)), f"{name} uses `global`"


def test_the_readme_python_examples_run_as_a_script(tmp_path):
    """Saved as a file and run from another folder, as a user would (tinygrad's CI runs its README
    the same way): a script is what the launcher's workers re-import, a notebook is not."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    for i, block in enumerate(blocks):
        script = tmp_path / f"readme_{i}.py"
        script.write_text(block)
        run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, f"README python block {i}:\n{run.stderr[-3000:]}"


def test_no_name_is_undefined_or_unused():
    """pyflakes' checks (ruff's F rules) over the package, bench/, the tests and the lessons: a name
    used but never defined fails only when its line runs (bench/zero_variants.py once lost its
    DTensor import, and only a benchmark run found it), and an unused import misleads a reader."""
    paths = [str(ROOT / d) for d in ("minipar", "bench", "tests", "notebooks")]
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache",
                           "--output-format", "concise", *paths], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_lesson_cell_has_an_id():
    """nbformat 4.5 cells carry an id; a cell added without one is a warning today ("will become a
    hard error in future nbformat versions") and was one in CI."""
    import json
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        assert all("id" in cell for cell in cells), f"{path.name}: a cell without an id"
