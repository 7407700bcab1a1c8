"""A stage's backward split into B (the input gradient) and W (the weight gradients), for zero-bubble schedules.

The split is done once, on the jaxpr of the fused backward: B is every equation the input gradient needs, W the
rest, and the values W reads from B are saved. So B + W cost what the fused backward costs, and their results
equal the VJP's bit for bit on the same backend.

Derivation: docs/explanation/pipeline-executor.md#splitting-a-backward-into-b-and-w
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, DebugInfo, DropVar, Jaxpr, JaxprEqn, Literal, Var, jaxpr_as_fun, unmapped_aval
from jax.extend.core import primitives as prims


@dataclasses.dataclass(frozen=True)
class SplitVjp:
    """A stage's backward as two programs: B (residuals, dy) -> (dx, saved) and W (residuals, saved) -> grads.

    `residuals` are the leaves of the stage's `jax.vjp` function (`jax.tree.leaves(vjp)`, weights
    included), in that order; either the list or the VJP function itself may be passed.
    """

    input_jaxpr: ClosedJaxpr  # (*residuals, *dy leaves) -> (dx, *saved)
    weight_jaxpr: ClosedJaxpr  # (*residuals, *saved) -> leaves of the weight gradients
    residual_avals: tuple[jax.ShapeDtypeStruct, ...]
    is_weight: tuple[bool, ...]  # which residual leaves are the stage's weights themselves (not stashed)
    saved: tuple[jax.ShapeDtypeStruct, ...]
    params_treedef: Any
    fused: Callable[[Sequence[jax.Array], jax.Array], tuple[Any, jax.Array]]  # the unsplit VJP, for comparison

    def input_grad(self, residuals: Any, dy: Any) -> tuple[jax.Array, list[jax.Array]]:
        """B: the gradient w.r.t. the stage input, and the values W will need (`dy`: the output's cotangent, a pytree
        when the stage's output is one)."""
        dx, *saved = jaxpr_as_fun(self.input_jaxpr)(*self._leaves(residuals), *jax.tree.leaves(dy))
        return dx, saved

    def weight_grad(self, residuals: Any, saved: Sequence[jax.Array]) -> Any:
        """W: the gradients w.r.t. the stage's weights, from the residuals and B's saved values."""
        grads = jaxpr_as_fun(self.weight_jaxpr)(*self._leaves(residuals), *saved)
        return jax.tree.unflatten(self.params_treedef, grads)

    @property
    def saved_bytes(self) -> int:
        """Bytes of the values B hands to W per (microbatch, chunk)."""
        return _nbytes(self.saved)

    @property
    def stash_bytes(self) -> int:
        """Bytes of the VJP residuals a pipeline stashes per (microbatch, chunk): all leaves but the weights."""
        return _nbytes(a for a, w in zip(self.residual_avals, self.is_weight, strict=True) if not w)

    @property
    def w_stash_bytes(self) -> int:
        """Bytes of the stashed residuals W reads: with `saved`, what a stash slot must keep from B until W."""
        w_reads = self.reads()[1]
        return _nbytes(a for a, w, r in zip(self.residual_avals, self.is_weight, w_reads, strict=True) if r and not w)

    def reads(self) -> tuple[list[bool], list[bool]]:
        """Which residual leaves B and W read: a leaf W does not read can be freed after B."""
        n = len(self.residual_avals)
        return _reads(self.input_jaxpr.jaxpr, n), _reads(self.weight_jaxpr.jaxpr, n)

    def _leaves(self, residuals: Any) -> list[jax.Array]:
        leaves = jax.tree.leaves(residuals)
        if [(leaf.shape, leaf.dtype) for leaf in leaves] != [(a.shape, a.dtype) for a in self.residual_avals]:
            raise ValueError("residuals do not match the traced VJP's leaves")
        return leaves


def split_vjp(stage_fn: Callable[..., Any], params: Any, x: Any, context: Any = None, *,
              recompute: bool = False, has_aux: bool = False) -> SplitVjp:
    """Split the VJP of stage_fn(params, x[, context]) w.r.t. (params, x) into B and W; traces abstractly.

    `params`, `x` and `context` may be arrays or `jax.ShapeDtypeStruct`s; `context` (e.g. document
    segments) is not differentiated, and None means stage_fn takes two arguments. The output may be a
    pytree (e.g. the activation and a loss term); has_aux: stage_fn returns (output, aux), as `jax.vjp`'s.
    recompute=False: W reuses every value B computed that it needs (B + W cost the fused backward).
    recompute=True: W recomputes the values that depend on the residuals alone (under remat=full,
    the layers' forward) and is handed only those that depend on dy; fewer saved bytes, more FLOPs.
    """
    found = {}

    def residuals(params, x, context):
        fn = (lambda p, x: stage_fn(p, x)) if context is None else (lambda p, x: stage_fn(p, x, context))
        y, vjp, *_ = jax.vjp(fn, params, x, has_aux=has_aux)
        leaves, found["treedef"] = jax.tree.flatten(vjp)
        weights = {id(w) for w in jax.tree.leaves(params)}  # forwarded weights appear as the very input arrays
        found["is_weight"] = tuple(id(leaf) in weights for leaf in leaves)
        return leaves, y

    res_avals, y_aval = jax.eval_shape(residuals, params, x, context)
    treedef = found["treedef"]

    def fused(leaves, dy):
        return jax.tree.unflatten(treedef, list(leaves))(dy)

    closed = jax.make_jaxpr(fused)(res_avals, y_aval)
    n_grads = len(closed.jaxpr.outvars) - 1
    n_res, n_dy = len(res_avals), len(jax.tree.leaves(y_aval))
    # dy is B's alone: by the time W runs, the cotangent buffer it came in has been reused.
    b_jaxpr, w_jaxpr, saved = _partition(closed.jaxpr, [False] * n_grads + [True], [True] * n_res + [False] * n_dy,
                                         recompute)
    params_treedef = jax.tree.structure(jax.eval_shape(lambda p: p, params))
    return SplitVjp(
        input_jaxpr=ClosedJaxpr(b_jaxpr, closed.consts),
        weight_jaxpr=ClosedJaxpr(w_jaxpr, closed.consts),
        residual_avals=tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in res_avals),
        is_weight=found["is_weight"],
        saved=tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in saved),
        params_treedef=params_treedef,
        fused=fused,
    )


# --- the partition of one jaxpr


def _partition(jaxpr: Jaxpr, b_out: list[bool], w_sees: list[bool],
               recompute: bool = False) -> tuple[Jaxpr, Jaxpr, list[Var]]:
    """Split `jaxpr` into B (all invars -> B's outvars + saved) and W (visible invars + saved -> W's outvars).

    b_out[i]: outvar i is B's (else W's). w_sees[i]: W may read invar i itself (else it gets it saved).
    recompute: W recomputes what it needs from B's equations that do not depend on B's own inputs.
    """
    jaxpr = _inline_calls(jaxpr)
    tagged = _b_slice(jaxpr, b_out, recompute)
    hidden = {v for v, sees in zip(jaxpr.invars, w_sees, strict=True) if not sees}
    dependent = _dependent(tagged, hidden) if recompute else None
    w_outs = [v for v, b in zip(jaxpr.outvars, b_out, strict=True) if not b]
    need = {v for v in w_outs if isinstance(v, Var)}
    w_eqns = []
    for eqn, in_b in reversed(tagged):
        if not any(v in need for v in eqn.outvars):
            continue
        if in_b and (dependent is None or any(v in dependent for v in eqn.outvars)):
            continue  # W reads this B equation's outputs as saved values
        w_eqns.append(eqn)
        need |= _vars(eqn.invars)
    w_eqns.reverse()
    b_eqns = [eqn for eqn, in_b in tagged if in_b]
    in_w = {id(eqn) for eqn in w_eqns}
    b_only = hidden | {v for eqn in b_eqns if id(eqn) not in in_w for v in eqn.outvars}
    # In definition order, so both programs agree on it without sorting Vars.
    saved = [v for v in (*jaxpr.invars, *(o for eqn in b_eqns for o in eqn.outvars)) if v in need and v in b_only]
    b_outs = [v for v, b in zip(jaxpr.outvars, b_out, strict=True) if b]
    b = _jaxpr(jaxpr.constvars, jaxpr.invars, [*b_outs, *saved], b_eqns)
    visible = [v for v, sees in zip(jaxpr.invars, w_sees, strict=True) if sees]
    w = _jaxpr(jaxpr.constvars, [*visible, *saved], w_outs, w_eqns)
    return b, w, saved


def _dependent(tagged: list[tuple[JaxprEqn, bool]], hidden: set[Var]) -> set[Var]:
    """The variables computed from W-hidden inputs (dy, B's scan carries): W cannot recompute them."""
    dependent = set(hidden)
    for eqn, _ in tagged:
        if any(v in dependent for v in _vars(eqn.invars)):
            dependent |= set(eqn.outvars)
    return dependent


def _b_slice(jaxpr: Jaxpr, b_out: list[bool], recompute: bool) -> list[tuple[JaxprEqn, bool]]:
    """The equations tagged B (in dx's backward slice) or not, mixed scans replaced by a B-scan and a W-scan."""
    need = {v for v, b in zip(jaxpr.outvars, b_out, strict=True) if b and isinstance(v, Var)}
    used = {v for eqn in jaxpr.eqns for v in _vars(eqn.invars)} | _vars(jaxpr.outvars)
    tagged = []
    for eqn in reversed(jaxpr.eqns):
        outs_b = [v in need for v in eqn.outvars]
        if not any(outs_b):
            tagged.append((eqn, False))
            continue
        w_wants = any(v in used and not b for v, b in zip(eqn.outvars, outs_b, strict=True))
        if w_wants and eqn.primitive is prims.scan_p:
            b_eqn, w_eqn = _split_scan(eqn, outs_b, recompute)
            tagged += [(w_eqn, False), (b_eqn, True)]
            need |= _vars(b_eqn.invars)
        else:  # the fallback: an equation both sides need runs whole in B
            tagged.append((eqn, True))
            need |= _vars(eqn.invars)
    tagged.reverse()
    return tagged


# --- scans


def _split_scan(eqn: JaxprEqn, outs_b: list[bool], recompute: bool) -> tuple[JaxprEqn, JaxprEqn]:
    """A scan into a B-scan (B's carries and ys, plus the per-iteration values W reads as extra ys) and a W-scan."""
    p = eqn.params
    body, nc, nk = p["jaxpr"], p["num_consts"], p["num_carry"]
    inner = _inline_calls(body.jaxpr)
    nx = len(inner.invars) - nc - nk
    b_carry = outs_b[:nk]
    while True:  # B's carries: those B needs, closed under what B's body reads
        b_mask = [*b_carry, *outs_b[nk:]]
        w_sees = [True] * nc + [not b for b in b_carry] + [True] * nx
        b_body, w_body, saved = _partition(inner, b_mask, w_sees, recompute)
        reads = _vars_read(b_body)
        grown = [b or v in reads for b, v in zip(b_carry, inner.invars[nc:nc + nk], strict=True)]
        if grown == b_carry:
            break
        b_carry = grown
    consts, carry, xs = _split3(eqn.invars, nc, nk)
    c_in, k_in, x_in = _split3(inner.invars, nc, nk)
    k_out, y_out = inner.outvars[:nk], inner.outvars[nk:]
    o_carry, o_ys = eqn.outvars[:nk], eqn.outvars[nk:]
    b_ys, w_ys = outs_b[nk:], [not b for b in outs_b[nk:]]
    w_carry = [not b for b in b_carry]

    # B-scan: its consts and xs that its body reads, B's carries; out: B's carries, B's ys, saved (stacked).
    b_reads = _vars_read(b_body)
    bc, bx = [v in b_reads for v in c_in], [v in b_reads for v in x_in]
    b_body = _jaxpr(b_body.constvars, [*_pick(c_in, bc), *_pick(k_in, b_carry), *_pick(x_in, bx)],
                    [*_pick(k_out, b_carry), *_pick(y_out, b_ys), *saved], b_body.eqns)
    stacked = [Var(unmapped_aval(p["length"], 0, v.aval)) for v in saved]
    b_eqn = _scan_eqn(eqn, b_body, body.consts, [*_pick(consts, bc), *_pick(carry, b_carry), *_pick(xs, bx)],
                      [*_pick(o_carry, b_carry), *_pick(o_ys, b_ys), *stacked], sum(bc), sum(b_carry))

    # W-scan: its consts, W's carries, its xs and the saved values as more xs; out: W's carries and ys.
    w_reads = _vars_read(w_body)
    wc, wx = [v in w_reads for v in c_in], [v in w_reads for v in x_in]
    w_body = _jaxpr(w_body.constvars, [*_pick(c_in, wc), *_pick(k_in, w_carry), *_pick(x_in, wx), *saved],
                    [*_pick(k_out, w_carry), *_pick(y_out, w_ys)], w_body.eqns)
    w_eqn = _scan_eqn(eqn, w_body, body.consts, [*_pick(consts, wc), *_pick(carry, w_carry), *_pick(xs, wx), *stacked],
                      [*_pick(o_carry, w_carry), *_pick(o_ys, w_ys)], sum(wc), sum(w_carry))
    return b_eqn, w_eqn


def _scan_eqn(like: JaxprEqn, body: Jaxpr, consts: list, invars: list, outvars: list, nc: int, nk: int) -> JaxprEqn:
    params = dict(like.params, jaxpr=ClosedJaxpr(body, consts), num_consts=nc, num_carry=nk)
    if "linear" in params:  # newer jax versions record which inputs are linear; none of ours need to be
        params["linear"] = (False,) * len(invars)
    return like.replace(invars=list(invars), outvars=list(outvars), params=params,
                        effects=body.effects)


# --- inlining calls


def _inline_calls(jaxpr: Jaxpr) -> Jaxpr:
    """The jaxpr with `jit`, `checkpoint` and `closed_call` equations replaced by their bodies (recursively)."""
    subst: dict[Var, Any] = {}
    sub = lambda atoms: [subst.get(a, a) if isinstance(a, Var) else a for a in atoms]
    eqns = []
    for eqn in jaxpr.eqns:
        eqn = eqn.replace(invars=sub(eqn.invars))
        body = _call_body(eqn)
        if body is None:
            eqns.append(eqn)
            continue
        inner, results = _renamed(_inline_calls(body), eqn.invars)
        eqns += inner
        subst.update((o, r) for o, r in zip(eqn.outvars, results, strict=True) if not isinstance(o, DropVar))
    if not subst:
        return jaxpr
    return _jaxpr(jaxpr.constvars, jaxpr.invars, sub(jaxpr.outvars), eqns)


def _call_body(eqn: JaxprEqn) -> Jaxpr | None:
    """The body of a call-like equation that can be inlined without changing its meaning, else None."""
    if eqn.primitive is prims.remat_p:
        return None if eqn.params["jaxpr"].constvars else eqn.params["jaxpr"]
    if eqn.primitive is prims.closed_call_p:
        closed = eqn.params["call_jaxpr"]
    elif eqn.primitive is prims.jit_p and _shardings_unspecified(eqn.params):
        closed = eqn.params["jaxpr"]
    else:
        return None
    return None if closed.consts else closed.jaxpr  # consts would have to move to the outer program: keep it


def _renamed(body: Jaxpr, args: list) -> tuple[list[JaxprEqn], list]:
    """The body's equations on fresh variables with its invars bound to `args`, and its results."""
    env: dict[Var, Any] = dict(zip(body.invars, args, strict=True))
    read = lambda a: env[a] if isinstance(a, Var) else a
    eqns = []
    for eqn in body.eqns:
        outs = []
        for v in eqn.outvars:
            new = DropVar(v.aval) if isinstance(v, DropVar) else Var(v.aval)
            env[v] = new
            outs.append(new)
        eqns.append(eqn.replace(invars=[read(a) for a in eqn.invars], outvars=outs))
    return eqns, [read(a) for a in body.outvars]


def _shardings_unspecified(params: dict) -> bool:
    """Whether a `jit` equation leaves every in/out sharding to the compiler (then inlining it changes nothing).

    The one use of a private JAX name here: `UnspecifiedValue` has no public alias (jax 0.10-0.11).
    If it moves, this returns False and such `jit` equations are kept whole (the fallback).
    """
    try:
        from jax._src.named_sharding import UnspecifiedValue  # jax 0.10 (sharding_impls re-exports it)
    except ImportError:  # pragma: no cover - a future jax
        try:
            from jax._src.sharding_impls import UnspecifiedValue
        except ImportError:
            return False
    return all(isinstance(s, UnspecifiedValue) for s in (*params["in_shardings"], *params["out_shardings"]))


# --- small helpers


def _jaxpr(constvars, invars, outvars, eqns) -> Jaxpr:
    effects = frozenset().union(*(eqn.effects for eqn in eqns))
    # A Jaxpr without DebugInfo is deprecated; these programs have no user-facing names to give.
    debug = DebugInfo("split_backward", "split_backward", ("",) * len(invars), ("",) * len(outvars))
    return Jaxpr(list(constvars), list(invars), list(outvars), list(eqns), effects, debug)


def _vars(atoms) -> set[Var]:
    return {a for a in atoms if isinstance(a, Var) and not isinstance(a, DropVar) and not isinstance(a, Literal)}


def _vars_read(jaxpr: Jaxpr) -> set[Var]:
    return {v for eqn in jaxpr.eqns for v in _vars(eqn.invars)} | _vars(jaxpr.outvars)


def _reads(jaxpr: Jaxpr, n: int) -> list[bool]:
    read = _vars_read(jaxpr)
    return [v in read for v in jaxpr.invars[:n]]


def _split3(seq, nc: int, nk: int):
    return list(seq[:nc]), list(seq[nc:nc + nk]), list(seq[nc + nk:])


def _pick(seq, mask) -> list:
    return [a for a, m in zip(seq, mask, strict=True) if m]


def _nbytes(avals) -> int:
    return sum(math.prod(a.shape) * jax.numpy.dtype(a.dtype).itemsize for a in avals)
