"""docs/reference/cli.md from the `spmd-train` argparse parser: every subcommand, its arguments and their help."""

from __future__ import annotations

import argparse

from spmd_train.cli.main import _parser

HEADER = """# Command-line reference

<!-- Generated from the argparse parser of spmd_train/cli/main.py by `make docs` (spmd_train/cli/reference_docs.py):
do not edit by hand; tests/test_reference_docs.py fails when this page and the parser differ. -->
"""
ABOUT = """`spmd-train` (or `python -m spmd_train`) is one command with subcommands. A bad argument or config exits
2 with one paragraph naming it; Ctrl-C while starting or compiling exits 130; a run that stopped itself to protect
its checkpoints exits 3. Where a subcommand takes `section.key=value` overrides, they may also follow its options; the
keys are in [config.md](config.md).
"""


def cli_reference(parser: argparse.ArgumentParser | None = None) -> str:
    """The markdown of docs/reference/cli.md (of `parser`, by default the `spmd-train` parser)."""
    parser = parser or _parser()
    commands = list(_commands(parser, "spmd-train"))
    index = ["| command | what it does |", "|---|---|"]
    index += [f"| [`{name}`](#{_anchor(name)}) | {_cell(summary)} |" for name, summary, _ in commands]
    out = [HEADER, *([parser.description + "\n"] if parser.description else []), ABOUT, "\n".join(index) + "\n"]
    for name, summary, sub in commands:
        out.append(_command_page(name, summary, sub))
    return "\n".join(out).rstrip() + "\n"


def _commands(parser: argparse.ArgumentParser, name: str):
    """(full command name, one-line help, parser) of every leaf subcommand, in the order they were added."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        seen: set[int] = set()
        for sub_name, sub in action.choices.items():
            if id(sub) in seen:  # an alias of a subcommand already listed
                continue
            seen.add(id(sub))
            full = f"{name} {sub_name}"
            if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                yield from _commands(sub, full)
            else:
                yield full, helps.get(sub_name, ""), sub


def _command_page(name: str, summary: str, parser: argparse.ArgumentParser) -> str:
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    lines = [f"## `{name}`\n", (parser.description or summary) + "\n", "```text", _usage(name, parser), "```\n"]
    groups = [g for g in parser._mutually_exclusive_groups if g._group_actions]
    for group in groups:
        flags = ", ".join(f"`{a.option_strings[0]}`" for a in group._group_actions)
        lines.append(f"{'Exactly' if group.required else 'At most'} one of {flags}.\n")
    if actions:
        lines += ["| argument | what it is | default |", "|---|---|---|"]
        lines += [f"| {_cell(_argument(a))} | {_cell(_help(a))} | {_cell(_default(a))} |" for a in actions]
    return "\n".join(lines) + "\n"


def _usage(name: str, parser: argparse.ArgumentParser) -> str:
    # Written here rather than by argparse, whose wrapping follows the terminal's width.
    groups = {id(a): g for g in parser._mutually_exclusive_groups for a in g._group_actions}
    words, done = [name], set()
    for action in parser._actions:
        group = groups.get(id(action))
        if isinstance(action, argparse._HelpAction) or id(group) in done:
            continue
        if group is None:
            word = _usage_word(action)
            words.append(word if not action.option_strings or action.required else f"[{word}]")
        else:
            done.add(id(group))
            choice = " | ".join(_usage_word(a) for a in group._group_actions)
            words.append(f"({choice})" if group.required else f"[{choice}]")
    return " ".join(words)


def _usage_word(action: argparse.Action) -> str:
    if not action.option_strings:
        return _metavar(action)
    flag = action.option_strings[-1]
    return flag if action.nargs == 0 else f"{flag} {_metavar(action)}"


def _argument(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{_metavar(action)}`"
    flag = ", ".join(action.option_strings)
    return f"`{flag} {_metavar(action)}`" if action.nargs != 0 else f"`{flag}`"


def _metavar(action: argparse.Action) -> str:
    metavar = action.metavar or (action.dest if not action.option_strings else action.dest.upper())
    if action.nargs == "*":
        return f"[{metavar} ...]"
    if action.nargs == "+":
        return f"{metavar} [{metavar} ...]"
    if action.nargs == "?":
        return f"[{metavar}]"
    return metavar


def _help(action: argparse.Action) -> str:
    text = (action.help or "").replace("%(default)s", str(action.default)).replace("%%", "%")
    notes = []
    if action.choices is not None:
        notes.append("one of " + ", ".join(f"`{c}`" for c in action.choices))
    if action.required and action.option_strings:
        notes.append("required")
    return "; ".join([text, *notes] if text else notes)


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or action.required:
        return ""
    if isinstance(action.default, list | tuple):
        return " ".join(f"`{v}`" for v in action.default)
    return f"`{action.default}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _anchor(heading: str) -> str:
    # GitHub's heading anchors: lower case, spaces to hyphens, other punctuation (the backticks) dropped.
    return "".join(c for c in heading.lower().replace(" ", "-") if c.isalnum() or c in "-_")
