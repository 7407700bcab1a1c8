"""Split the text form of an HLO module into computations and their instructions.

An instruction is one line, except where an attribute's text holds newlines (a Pallas kernel's
`kernel_metadata={...}` or a quoted `backend_config`, say): its text then goes on until its
brackets balance, quoted strings skipped, and those lines are joined to it before it is split
into name, shape, opcode, operands and attributes. So a continuation line starting with `}` does
not end the computation; only a `}` outside any instruction does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_STRING_END = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*(?:(")|\\?$)')
"""The rest of a quoted string from inside it: up to its closing quote (group 1), else to the end of the line."""


@dataclass
class Instruction:
    """One HLO instruction: `name = shape opcode(operands), attributes`."""

    name: str
    shape: str
    opcode: str
    operands: list[str]
    rest: str
    """Everything after the opcode's opening parenthesis: operands, then the attributes."""


def parse_computations(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Each computation's instructions in order, and the entry computation's name, in one pass over the lines."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    pending: list[str] = []  # an instruction whose brackets are still open: its name, its text's lines
    depth, in_string = 0, False
    for line in text.splitlines():
        if pending:
            pending.append(line)
            depth, in_string = _balance(line, depth, in_string)
            if depth <= 0 and not in_string:
                computations[current].append(split_instruction(pending[0], "\n".join(pending[1:])))
                pending = []
            continue
        if not line.startswith(" "):
            header = _HEADER.match(line)
            if header and "=" not in line.split("(")[0]:
                current = header.group(2)
                computations[current] = []
                if header.group(1):
                    entry = current
            elif line.startswith("}"):
                current = None
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        depth, in_string = _balance(m.group(2), 0, False)
        if depth > 0 or in_string:
            pending = [m.group(1), m.group(2)]
        else:
            computations[current].append(split_instruction(m.group(1), m.group(2)))
    if pending:  # brackets never closed: keep what there is
        computations[current].append(split_instruction(pending[0], "\n".join(pending[1:])))
    if not entry and computations:
        entry = next(reversed(computations))
    return computations, entry


def _balance(line: str, depth: int, in_string: bool) -> tuple[int, bool]:
    """Open brackets, braces and parentheses after `line`, and whether it ends inside a quoted string.

    Linear in the line, in C but for a Python step per quoted string with a backslash in it.
    """
    if "\\" not in line:  # no escapes: every quote opens or closes a string
        parts = line.split('"')
        return depth + _opened("".join(parts[1::2] if in_string else parts[::2])), in_string != (len(parts) % 2 == 0)
    pos = 0
    if in_string:
        end = _STRING_END.match(line)
        if not end.group(1):
            return depth, True
        pos = end.end()
    while (quote := line.find('"', pos)) >= 0:
        depth += _opened(line[pos:quote])
        end = _STRING_END.match(line, quote + 1)
        if not end.group(1):
            return depth, True
        pos = end.end()
    return depth + _opened(line[pos:]), False


def _opened(code: str) -> int:
    return (code.count("(") + code.count("{") + code.count("[")
            - code.count(")") - code.count("}") - code.count("]"))


def split_instruction(name: str, body: str) -> Instruction:
    """An instruction from its name and the text after `=`: shape, opcode, operand names, the rest."""
    if body.startswith("("):
        end = _closing(body, 1)
        shape, after = body[: end + 1], body[end + 1 :].lstrip()
    else:
        shape, _, after = body.partition(" ")
    opcode, _, args = after.partition("(")
    operands = re.findall(r"%([\w.\-]+)", args[: max(_closing(args, 0), 0)])
    return Instruction(name, shape, opcode.strip(), operands, args)


def _closing(text: str, start: int) -> int:
    """Where the parenthesis open just before `start` closes (the last index if it does not)."""
    close = text.find(")", start)
    if close >= 0 and text.find("(", start, close) < 0:  # nothing nested: no Python loop
        return close
    depth = 1
    for i in range(start, len(text)):
        depth += (text[i] == "(") - (text[i] == ")")
        if depth == 0:
            return i
    return len(text) - 1
