"""The operand specs of a two-operand einsum and the equations of its two gradients."""

from __future__ import annotations


def operands(equation: str) -> tuple[str, str, str]:
    """("bld", "dhk", "blhk") for "bld,dhk->blhk"."""
    inputs, out = equation.replace(" ", "").split("->")
    a, b = inputs.split(",")
    return a, b, out


def gradient_equations(equation: str) -> tuple[str, str]:
    """The einsums of the gradients with respect to the first and second operand, each (output gradient, the other
    operand): "blhk,dhk->bld" and "bld,blhk->dhk" for "bld,dhk->blhk". Every axis of an operand must appear in the
    other operand or the output (no axis summed within one operand alone)."""
    a, b, out = operands(equation)
    if set(a) - set(b) - set(out) or set(b) - set(a) - set(out):
        raise ValueError(f"einsum {equation!r}: an axis summed within one operand alone is not a matmul")
    return f"{out},{b}->{a}", f"{a},{out}->{b}"


def explicit(equation: str, ndim_a: int, ndim_b: int) -> str:
    """`equation` with its "..." spelled out as letters it does not use (each operand's leading axes that "..."
    stands for, as many as its rank leaves; an operand without "..." keeps its spec)."""
    if "..." not in equation:
        return equation
    whole = operands(equation)
    free = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation]
    count = max(nd - len(spec.replace("...", "")) for spec, nd in zip(whole[:2], (ndim_a, ndim_b), strict=True)
                if "..." in spec)
    leading = "".join(free[:count])
    return equation.replace(" ", "").replace("...", leading)
