"""Size stays honest (STYLE.md): every module readable in one sitting, lines readable beside a notebook."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_modules_are_short_and_lines_readable():
    for path in sorted((ROOT / "minipar").rglob("*.py")):
        lines = path.read_text().splitlines()
        assert len(lines) <= 400, f"{path.name} has {len(lines)} lines: split it"
        long = [i + 1 for i, line in enumerate(lines) if len(line) > 120]
        assert not long, f"{path.name}: lines {long} are over 120 characters"


def test_the_readme_python_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks, "the README has no python example"
    exec(compile(blocks[0], "README.md", "exec"), {})
