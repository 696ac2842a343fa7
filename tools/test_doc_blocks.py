"""Tests of tools/run_doc_blocks.py (run by `nox -s lint`)."""

from run_doc_blocks import ROOT, owner, program, python_blocks

PAGE = """# t

```python
x = 1
```

```bash
not python
```

```text
nor this
```

```python
assert x == 1
```
"""


def test_only_python_blocks_with_their_lines():
    blocks = python_blocks(PAGE)
    assert blocks == [(4, "x = 1\n"), (16, "assert x == 1\n")]


def test_owner():
    assert owner(ROOT / "packages" / "mhc-proj" / "README.md") == "mhc-proj"
    assert owner(ROOT / "docs" / "flashsinkhorn-second-order.md") == "flashsinkhorn"
    assert owner(ROOT / "docs" / "design" / "flashoptim.md") == "flashoptim"
    assert owner(ROOT / "docs" / "index.md") == "all"


def test_program_runs_blocks_in_one_namespace(tmp_path):
    page = ROOT / "docs" / "_test_page.md"
    try:
        page.write_text(PAGE)
        namespace = {}
        exec(program(page), namespace)  # the second block sees the first one's x
    finally:
        page.unlink()
