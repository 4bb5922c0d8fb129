"""The README's first example runs as pasted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_as_pasted(tmp_path: Path) -> None:
    """The first python block of README.md runs in an empty directory and finishes the run."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert blocks, "README.md has no python example"
    result = subprocess.run(
        [sys.executable, "-c", blocks[0]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "status=<RunStatus.DONE: 'done'>" in result.stdout
    assert "done_count=2" in result.stdout
    assert (tmp_path / "quickstart.db").exists()
