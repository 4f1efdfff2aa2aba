"""The server's modules stay short enough to read in one sitting (issue 40): none in
``tokenloom/api/`` is over :data:`MAX_MODULE_LINES` lines except the flag catalogue, which is
data. A module that grows past it is split where its concerns part, not defended in its
docstring."""

from __future__ import annotations

import re
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "tokenloom" / "api"
MAX_MODULE_LINES = 500
# module -> why it may be longer
DATA_MODULES = {"flags.py": "the flag catalogue: one row per vLLM serve flag"}
LENGTH_DEFENCE = re.compile(r"Over ~?\d+ lines")


def test_no_server_module_is_over_the_limit():
    long_modules = {
        path.name: num_lines
        for path in sorted(API.glob("*.py"))
        if path.name not in DATA_MODULES
        and (num_lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long_modules == {}, f"split these at their seams: {long_modules}"


def test_every_exempt_module_exists_and_no_docstring_defends_its_length():
    assert all((API / name).is_file() for name in DATA_MODULES)
    defended = [
        path.name for path in sorted(API.glob("*.py")) if LENGTH_DEFENCE.search(path.read_text(encoding="utf-8"))
    ]
    assert defended == []
