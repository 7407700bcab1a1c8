"""Read the collectives out of a compiled (post-optimisation, SPMD-partitioned) HLO module.

Only the text form is stable across jax/XLA versions, so this parses it (`hlo_text` splits it
into computations and instructions, those spanning several lines included): the call graph
(with while-loop trip counts, so a collective in a scanned layer counts once per layer), each
collective's operands, and its device groups in every replica-group syntax XLA prints (explicit
lists, iota `[G,S]<=[dims]T(perm)`, and the mesh form `mesh['a'=2,'b'=4], device_ids=(...) {'a'}`).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, replace

import numpy as np

from spmd_train.analysis.hlo_text import Instruction, parse_computations
from spmd_train.kernels.flash_attention.kernel import KERNEL_MATMULS, KernelPlan, visible_pairs

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e3m4": 1,
    "f8e8m0fnu": 1, "f4e2m1fn": 0.5,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_CALLEE = re.compile(
    r"\b(calls|to_apply|body|condition|branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)"
)
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of the compiled program."""

    kind: str
    """all-reduce, all-gather, reduce-scatter, all-to-all or collective-permute."""
    operand_bytes: float
    """Bytes of the operand(s) on one device."""
    groups: tuple[tuple[int, ...], ...] | None
    """Device groups (partition ids); for collective-permute, the (source, target) pairs."""
    executions: int
    """How many times one step runs it (product of enclosing loop trip counts)."""
    trip_count_known: bool
    name: str
    op_name: str
    slices: int = 0
    """For a transfer between TPU slices over DCN (multislice), how many slices take part; 0 on a slice."""

    @property
    def group_size(self) -> int:
        """N, the number of devices taking part in one group (2 for a permute pair)."""
        if self.slices:
            return self.slices
        return max((len(g) for g in self.groups), default=1) if self.groups else 1

    @property
    def bytes_per_execution(self) -> float:
        """Bytes one device sends per execution with a bandwidth-optimal algorithm."""
        n, size = self.group_size, self.operand_bytes
        if self.kind == "collective-permute":
            return size
        if self.kind == "all-gather":
            return (n - 1) * size  # (N-1)/N of an output N times the operand
        if self.kind == "all-reduce":
            return 2 * (n - 1) / n * size
        return (n - 1) / n * size  # reduce-scatter (of its input), all-to-all


def parse_collectives(hlo_text: str, num_devices: int) -> list[CollectiveOp]:
    """Every collective in a compiled HLO module, with how often one execution of the module runs it."""
    computations, entry = parse_computations(hlo_text)
    executions, known = _executions(computations, entry)
    fused = {
        callee
        for instructions in computations.values()
        for ins in instructions
        if ins.opcode == "fusion"
        for callee in re.findall(r"calls=%?([\w.\-]+)", ins.rest)
    }
    plain: list[CollectiveOp] = []
    # Async lowerings (XLA:TPU) clone one collective into several fusions (start, done, ...)
    # that share its channel, shape, groups and source: count such a family once.
    families: dict[tuple, dict[str, list[CollectiveOp]]] = defaultdict(lambda: defaultdict(list))
    for comp_name, instructions in computations.items():
        shapes = {ins.name: ins.shape for ins in instructions}
        for ins in instructions:
            dcn = _over_dcn(ins, shapes)
            if dcn is not None:
                if executions.get(comp_name, 0):
                    plain.append(replace(dcn, executions=executions[comp_name], trip_count_known=known[comp_name]))
                continue
            kind = _collective_kind(ins.opcode)
            if kind is None or executions.get(comp_name, 0) == 0:
                continue
            if kind == "all-reduce" and comp_name.startswith("all-reduce-scatter"):
                # XLA:TPU's fused reduce-scatter: an all-reduce + slice that runs as one reduce-scatter.
                kind = "reduce-scatter"
            operand_bytes = sum(_shape_bytes(shapes.get(op, "")) for op in ins.operands)
            if operand_bytes == 0:  # operands printed inline with their shapes
                operand_bytes = _shape_bytes(_inline_operand_shapes(ins.rest))
            groups = _groups(ins.rest, kind, num_devices)
            op_name = re.search(r'op_name="([^"]*)"', ins.rest)
            op = CollectiveOp(kind, operand_bytes, groups, executions[comp_name], known[comp_name], ins.name,
                              op_name.group(1) if op_name else "")
            channel = _CHANNEL.search(ins.rest)
            if comp_name in fused and channel and not comp_name.startswith("all-reduce-scatter"):
                families[(channel.group(1), kind, operand_bytes, groups, op.op_name)][comp_name].append(op)
            else:
                plain.append(op)
    for per_comp in families.values():
        plain.extend(max(per_comp.values(), key=lambda ops: (len(ops), ops[0].executions)))
    return plain


_MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_MEGASCALE_TARGET = re.compile(r'_xla_megascale_target="\{([\d,]*)\}')
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather", "REDUCE_SCATTER": "reduce-scatter",
                    "ALL_TO_ALL": "all-to-all", "ONE_TO_ONE": "collective-permute"}


def _over_dcn(ins: Instruction, shapes: dict[str, str]) -> CollectiveOp | None:
    """A collective between TPU slices: XLA:TPU lowers it to a host-transfer `send` to the megascale runtime (with
    its `recv`), not to a collective instruction; its target's first set lists the slices taking part."""
    if ins.opcode != "send":
        return None
    kind = _MEGASCALE.search(ins.rest)
    if kind is None or kind.group(1) not in _MEGASCALE_KINDS:
        return None
    target = _MEGASCALE_TARGET.search(ins.rest)
    slices = len([x for x in target.group(1).split(",") if x]) if target else 0
    operand_bytes = sum(_shape_bytes(shapes.get(op, "")) for op in ins.operands)
    op_name = re.search(r'op_name="([^"]*)"', ins.rest)
    return CollectiveOp(_MEGASCALE_KINDS[kind.group(1)], operand_bytes, None, 0, True, ins.name,
                        op_name.group(1) if op_name else "", slices=max(slices, 2))


def _collective_kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    if opcode.endswith("-done"):
        return None
    return base if base in COLLECTIVES else None


def _executions(computations, entry) -> tuple[dict[str, int], dict[str, bool]]:
    edges: dict[str, list[tuple[str, int, bool]]] = defaultdict(list)
    for comp, instructions in computations.items():
        by_name = {ins.name: ins for ins in instructions}
        for ins in instructions:
            trip = _trip_count(ins, by_name, computations) if ins.opcode == "while" else None
            for role, target in _CALLEE.findall(ins.rest):
                for callee in re.findall(r"%?([\w.\-]+)", target.strip("{}")):
                    if callee not in computations:
                        continue
                    if ins.opcode == "while" and role in ("body", "condition"):
                        times = (trip or 1) + (role == "condition" and trip is not None)
                        edges[comp].append((callee, times, trip is not None))
                    else:
                        edges[comp].append((callee, 1, True))
    # Call graphs are acyclic: count paths from the entry, weighted by trip counts.
    indegree: dict[str, int] = defaultdict(int)
    for comp in computations:
        for callee, _, _ in edges[comp]:
            indegree[callee] += 1
    executions = dict.fromkeys(computations, 0)
    known = dict.fromkeys(computations, True)
    executions[entry] = 1
    ready = [c for c in computations if indegree[c] == 0]
    while ready:
        comp = ready.pop()
        for callee, times, exact in edges[comp]:
            executions[callee] += executions[comp] * times
            known[callee] = known[callee] and known[comp] and exact
            indegree[callee] -= 1
            if indegree[callee] == 0:
                ready.append(callee)
    return executions, known


def _trip_count(ins: Instruction, by_name: dict[str, Instruction], computations) -> int | None:
    """A while loop's trip count: XLA's annotation, else read off `i < N` with a constant start."""
    known = _TRIP.search(ins.rest)
    if known:
        return int(known.group(1))
    cond_name = re.search(r"condition=%?([\w.\-]+)", ins.rest)
    cond = computations.get(cond_name.group(1)) if cond_name else None
    if not cond:
        return None
    local = {i.name: i for i in cond}
    root = cond[-1]
    if root.opcode != "compare" or "direction=LT" not in root.rest or len(root.operands) != 2:
        return None
    counter, limit = (local.get(o) for o in root.operands)
    if not counter or not limit or counter.opcode != "get-tuple-element" or limit.opcode != "constant":
        return None
    index = re.search(r"index=(\d+)", counter.rest)
    init_tuple = by_name.get(ins.operands[0]) if ins.operands else None
    if not index or not init_tuple or init_tuple.opcode != "tuple":
        return None
    start = by_name.get(init_tuple.operands[int(index.group(1))])
    while start is not None and start.opcode in ("copy", "bitcast", "reshape") and start.operands:
        start = by_name.get(start.operands[0])
    if not start or start.opcode != "constant":
        return None
    return int(_constant(limit)) - int(_constant(start))


def _constant(ins: Instruction) -> float:
    return float(ins.rest.split(")", 1)[0])


def _shape_bytes(shape: str) -> float:
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _inline_operand_shapes(args: str) -> str:
    return args.split(")", 1)[0]


def _groups(rest: str, kind: str, num_devices: int) -> tuple[tuple[int, ...], ...] | None:
    if kind == "collective-permute":
        m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", rest)
        return tuple(tuple(int(x) for x in p) for p in re.findall(r"\{(\d+),(\d+)\}", m.group(1))) if m else None
    m = re.search(r"replica_groups=", rest)
    if not m:
        return (tuple(range(num_devices)),)
    spec = rest[m.end():]
    if spec.startswith("{"):
        body = spec[: _matching_brace(spec) + 1]
        groups = tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", body[1:-1]))
        return groups or (tuple(range(num_devices)),)
    if spec.startswith("["):
        iota = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
        if iota:
            shape = [int(x) for x in iota.group(1).split(",")]
            rows = _iota(iota.group(2), iota.group(3)).reshape(shape[0], -1)
            return tuple(tuple(int(x) for x in row) for row in rows)
    if spec.startswith("mesh["):
        return _mesh_groups(spec)
    return None


def _mesh_groups(spec: str) -> tuple[tuple[int, ...], ...] | None:
    m = re.match(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*(?:\{([^}]*)\})?", spec)
    if not m:
        return None
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
    ids = np.arange(math.prod(sizes))
    if m.group(2):
        dev = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", m.group(2))
        if dev:
            ids = _iota(dev.group(1), dev.group(2)).reshape(-1)
        else:
            ids = np.array([int(x) for x in re.findall(r"\d+", m.group(2))])
    grid = ids.reshape(sizes)
    over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3) or "")]
    rest = [i for i in range(len(names)) if i not in over]
    grouped = grid.transpose(rest + over).reshape(-1, math.prod(sizes[i] for i in over) if over else 1)
    return tuple(tuple(int(x) for x in row) for row in grouped)


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(x) for x in dims.split(",")]
    arr = np.arange(math.prod(shape)).reshape(shape)
    return arr.transpose([int(x) for x in perm.split(",")]) if perm else arr


def _matching_brace(text: str) -> int:
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0:
            return i
    return len(text) - 1


def attention_kernel_flops(hlo_text: str) -> float:
    """The part of `matmul_flops` inside our flash-attention kernels (0 when the program runs none)."""
    return matmul_flops(hlo_text, kernels_only=True)


def matmul_flops(hlo_text: str, *, kernels_only: bool = False) -> float:
    """FLOPs of the dots and convolutions one execution of the module runs, loop trip counts included.

    XLA's own cost analysis counts a while-loop body once whatever its trip count, which
    undercounts a scanned layer stack L-fold; this walks the same call graph as the
    collectives. A dot costs 2 x output elements x contracted size. XLA:TPU writes batched
    matmuls as convolutions whose windows walk batch dimensions over padding and dilation
    holes; those are counted exactly: only (output, window) pairs that meet a real input
    element do arithmetic. Our Pallas flash-attention kernels are opaque custom calls; their
    matmuls are counted from the kernel's name (causality, block sizes) and operand shapes.
    """
    computations, entry = parse_computations(hlo_text)
    executions, _ = _executions(computations, entry)
    total = 0.0
    for comp_name, instructions in computations.items():
        times = executions.get(comp_name, 0)
        if not times:
            continue
        shapes = {ins.name: ins.shape for ins in instructions}
        for ins in instructions:
            if ins.opcode == "custom-call":
                total += times * _flash_attention_flops(ins, shapes)
                continue
            if kernels_only or ins.opcode not in ("dot", "convolution") or len(ins.operands) < 2:
                continue
            out = _dims(ins.shape)
            if ins.opcode == "dot":
                lhs = _dims(shapes.get(ins.operands[0], ""))
                contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
                dims = contracting.group(1).split(",") if contracting and lhs else []
                size = math.prod(lhs[int(d)] for d in dims if d) if contracting and lhs else 0
            else:
                size = _conv_macs_per_output(ins, shapes, out)
            total += times * 2.0 * math.prod(out) * size
    return total


_FLASH = re.compile(r"flash_attention_(fwd|dq|dkv)(_causal)?(?:_w(\d+))?(?:_o(\d+))?_q(\d+)_k(\d+)")


def _flash_attention_flops(ins: Instruction, shapes: dict[str, str]) -> float:
    """Matmul FLOPs inside one of our flash-attention kernels: per visible block pair (causality, window and
    query offset from the kernel's name), KERNEL_MATMULS block matmuls of 2 x block_q x block_k x head_dim, over
    batch x query heads."""
    m = _FLASH.match(ins.name.lstrip("%"))
    if not m or len(ins.operands) < 2:
        return 0.0
    kind, causal = m.group(1), bool(m.group(2))
    window, offset = (int(m.group(3)) if m.group(3) else None), int(m.group(4) or 0)
    bq, bk = int(m.group(5)), int(m.group(6))
    q, k = _dims(shapes.get(ins.operands[0], "")), _dims(shapes.get(ins.operands[1], ""))
    if len(q) != 4 or len(k) != 4:
        return 0.0
    (b, h, lq, d), lk = q, k[2]
    plan = KernelPlan(scale=1.0, causal=causal, block_q=bq, block_k=bk, q_len=lq, kv_len=lk, groups=1,
                      interpret=False, window=window, q_offset=offset)
    return KERNEL_MATMULS[kind] * 2.0 * b * h * visible_pairs(plan, lq // bq, lk // bk) * bq * bk * d


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _conv_macs_per_output(ins: Instruction, shapes: dict[str, str], out: list[int]) -> float:
    """Multiply-adds per output element of a convolution, averaged over its spatial positions."""
    labels = re.search(r"dim_labels=([^_]+)_([^-]+)->(\S+?)[,\s]", ins.rest + " ")
    lhs, kernel = _dims(shapes.get(ins.operands[0], "")), _dims(shapes.get(ins.operands[1], ""))
    if not labels or not lhs or not kernel:
        return 0.0
    lhs_l, ker_l, out_l = labels.groups()
    features = kernel[ker_l.index("i")]
    window = re.search(r"window=\{([^}]*)\}", ins.rest)
    attrs = dict(kv.split("=") for kv in window.group(1).split()) if window else {}
    spatial = [c for c in ker_l if c.isdigit()]
    pairs = 1.0
    for n, digit in enumerate(spatial):
        def attr(key, default, n=n):
            return int(attrs[key].split("x")[n]) if key in attrs else default

        k = kernel[ker_l.index(digit)]
        stride, lhs_dil, rhs_dil = attr("stride", 1), attr("lhs_dilate", 1), attr("rhs_dilate", 1)
        lo = int(attrs["pad"].split("x")[n].split("_")[0]) if "pad" in attrs else 0
        size, positions = lhs[lhs_l.index(digit)], out[out_l.index(digit)]
        dilated = (size - 1) * lhs_dil + 1
        o = np.arange(positions)[:, None]
        x = o * stride + np.arange(k)[None, :] * rhs_dil - lo
        valid = (x >= 0) & (x < dilated) & (x % lhs_dil == 0)
        pairs *= valid.sum() / positions
    return features * pairs
