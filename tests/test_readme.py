"""The README's metadata example runs as written (on CPU, the reference implementations) and prints
what its comments say."""
import contextlib
import io
import pathlib
import re

import torch_dsv4_ops

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_metadata_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = [b for b in blocks if "SWAMetadataBuilder(" in b]
    assert len(example) == 1
    out = io.StringIO()
    with contextlib.redirect_stdout(out), torch_dsv4_ops.cpu_implementation("reference"):
        exec(compile(example[0], "README.md", "exec"), {})
    lines = out.getvalue().splitlines()
    assert lines[0] == "2 1 4 5"
    assert "6474" in out.getvalue() and "6688" in out.getvalue()
