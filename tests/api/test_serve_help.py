"""``tokenloom serve --help``: the overview, a group, a flag, a keyword and the group list."""

from __future__ import annotations

from tokenloom.api import flags
from tokenloom.api.cli import main


def help_output(capsys, *argv) -> tuple[int, str]:
    code = main(["serve", *argv])
    return code, capsys.readouterr().out


def test_plain_help_lists_the_groups(capsys):
    code, out = help_output(capsys, "--help")
    assert code == 0 and "usage: tokenloom serve [MODEL] [flags]" in out
    for group in flags.GROUPS:
        assert group in out
    assert "--help=listgroup" in out


def test_help_for_a_group_a_flag_a_keyword_and_the_group_list(capsys):
    code, out = help_output(capsys, "--help=ModelConfig")
    assert code == 0 and "--max-model-len MAX_MODEL_LEN" in out and "--port" not in out
    code, out = help_output(capsys, "--help=cacheconfig")
    assert "--block-size" in out and "[ignored on the CPU]" in out  # --swap-space
    code, out = help_output(capsys, "--help=max-model-len")
    assert out.strip().startswith("--max-model-len MAX_MODEL_LEN") and "Model context length" in out
    assert "(default: None)" in out
    code, out = help_output(capsys, "--help=-tp")
    assert "--tensor-parallel-size TENSOR_PARALLEL_SIZE, -tp" in out
    code, out = help_output(capsys, "--help=PREFIX")
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in out and "--prefix-caching-hash-algo" in out
    code, out = help_output(capsys, "--help=listgroup")
    assert out.splitlines()[0].startswith("Frontend:") and len(out.splitlines()) == len(flags.GROUPS)
    code, out = help_output(capsys, "--help=additional-config")
    assert "[not implemented]" in out
    code, out = help_output(capsys, "--help=zzzzzz")
    assert code == 2 and "no flag, group or keyword matches 'zzzzzz'" in out
