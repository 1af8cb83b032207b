"""The README's Ray Serve LLM block is the code the Serve end-to-end test runs.

tests/e2e/test_serve_llm.py loads examples/serve_llm.py and serves through its ``build_app``;
the README shows ``build_app`` and the helper it calls, verbatim. Both files are read as
text (no Ray Serve needed here), so this runs in the unit suite.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "serve_llm.py"
SERVE_TEST = REPO / "tests" / "e2e" / "test_serve_llm.py"
SHOWN = ("_connector_options", "build_app")  # build_app and what it calls from the file
BEGIN, END = "<!-- serve_llm.py:begin -->\n```python\n", "\n```\n<!-- serve_llm.py:end -->"


def _functions(path: Path) -> dict[str, str]:
    source = path.read_text()
    return {
        node.name: ast.get_source_segment(source, node) or ""
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef)
    }


def readme_block() -> str:
    readme = (REPO / "README.md").read_text()
    assert readme.count(BEGIN) == 1 and readme.count(END) == 1, "README: one serve_llm block"
    return readme.split(BEGIN, 1)[1].split(END, 1)[0]


def test_readme_shows_build_app_verbatim():
    functions = _functions(EXAMPLE)
    assert readme_block() == "\n\n\n".join(functions[name] for name in SHOWN)


def test_build_app_calls_no_other_function_of_the_example():
    """Every function of the example that build_app reaches is shown."""
    functions = _functions(EXAMPLE)
    called = {
        node.func.id
        for node in ast.walk(ast.parse(functions["build_app"]))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert called & set(functions) <= set(SHOWN)


def test_the_serve_e2e_test_serves_through_the_examples_build_app():
    tree = ast.parse(SERVE_TEST.read_text())
    calls = [
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    ]
    assert "build_app" in calls
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)}
    assert {"examples", "serve_llm.py"} <= strings  # EXAMPLE = .../examples/serve_llm.py
