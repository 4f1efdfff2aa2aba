"""``tokenloom serve --help``: the overview, ``--help=GROUP``, ``--help=FLAG``,
``--help=KEYWORD``, ``--help=listgroup`` and ``--help=all``, rendered from the flag catalogue
(:mod:`tokenloom.api.flags`). Imports nothing heavy.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from tokenloom.api import flags as catalogue
from tokenloom.api.flags import CLI, CPU_NOOP, FLAG_BY_NAME, FLAGS, GROUPS, NOOP, UNIMPLEMENTED, Flag
from tokenloom.api.serve_args import DEFAULT_MODEL, format_value


def help_request(argv: Sequence[str]) -> str | None:
    """ "" for plain --help, the part after ``--help=`` otherwise, None without a help flag."""
    for token in argv:
        if token == "--":
            break
        if token in ("-h", "--help"):
            return ""
        if token.startswith("--help="):
            return token.split("=", 1)[1]
    return None


def render_serve_help(request: str) -> tuple[str, bool]:
    """The help text for ``--help=request`` and whether anything matched."""
    if request == "":
        return _serve_overview(), True
    if request.lower() == "listgroup":
        return "\n".join(f"{group}: {description}" for group, description in GROUPS.items()), True
    if request.lower() == "all":
        return "\n\n".join(_group_help(group) for group in GROUPS), True
    group = next((name for name in GROUPS if name.lower() == request.lower()), None)
    if group is not None:
        return _group_help(group), True
    flag = FLAG_BY_NAME.get(request) or FLAG_BY_NAME.get("--" + request.lstrip("-"))
    if flag is not None:
        return _flag_help(flag), True
    keyword = request.lower()
    matches = [flag for flag in FLAGS if keyword in flag.name.lower() or keyword in catalogue.help_text(flag).lower()]
    if not matches:
        return (f"no flag, group or keyword matches {request!r}; see tokenloom serve --help=listgroup"), False
    return "\n".join([f"flags matching {request!r}:", *(_flag_help(flag) for flag in matches)]), True


def _serve_overview() -> str:
    counts = {group: [flag for flag in FLAGS if flag.group == group] for group in GROUPS}
    lines = [
        "usage: tokenloom serve [MODEL] [flags]",
        "",
        f"Serve MODEL (default: {DEFAULT_MODEL}) over an OpenAI-compatible HTTP API. Flags take vLLM's names;",
        "flags tokenloom does not implement are refused by name, and flags that mean nothing on the CPU",
        "are accepted with a warning.",
        "",
        "flag groups (implemented/all flags):",
    ]
    for group, members in counts.items():
        implemented = sum(flag.status == catalogue.IMPLEMENTED for flag in members)
        lines.append(f"  {group:<24}{implemented:>2}/{len(members):<3} {GROUPS[group]}")
    lines += [
        "",
        "  --help=GROUP      the flags of one group, e.g. --help=ModelConfig",
        "  --help=FLAG       one flag, e.g. --help=max-model-len",
        "  --help=KEYWORD    flags whose name or help mentions KEYWORD, e.g. --help=prefix",
        "  --help=listgroup  the groups;  --help=all  every flag",
    ]
    return "\n".join(lines)


def _group_help(group: str) -> str:
    return "\n".join([f"{group}: {GROUPS[group]}", *(_flag_help(flag) for flag in FLAGS if flag.group == group)])


_STATUS_TAGS = {
    catalogue.IMPLEMENTED: "",
    CPU_NOOP: "[ignored on the CPU] ",
    NOOP: "[no effect] ",
    UNIMPLEMENTED: "[not implemented] ",
}


def _flag_help(flag: Flag) -> str:
    metavar = flag.metavar
    if metavar and flag.nargs == "+":
        metavar = f"{metavar} [{metavar} ...]"
    elif metavar and flag.nargs == "?":
        metavar = f"[{metavar}]"
    names = [flag.name + (f" {metavar}" if metavar else ""), *flag.aliases]
    if flag.negatable:
        names.append("--no-" + flag.name[2:])
    text = _STATUS_TAGS[flag.status] + ("(tokenloom) " if flag.tokenloom_only else "") + catalogue.help_text(flag)
    if flag.note and flag.status != catalogue.IMPLEMENTED:
        text += f" ({flag.note})"
    if flag.to != CLI:
        text += f" (default: {format_value(catalogue.default_value(flag))})"
    body = textwrap.fill(text, width=96, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return f"  {', '.join(names)}\n{body}"
