"""Logical axis names -> mesh PartitionSpecs, and the ZeRO stage's choice of layout per tree."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd_train.config.mesh_schema import LOGICAL_AXES, ZERO_AXES
from spmd_train.config.resolved_rules import ResolvedRules, resolve_rules
from spmd_train.config.schema import Config
from spmd_train.errors import ConfigError
from spmd_train.sharding.arithmetic import entry_axes, spec_axes, spec_entry, ways

LogicalSpec = P
"""A PartitionSpec whose entries are logical axis names (or None), e.g. P('embed', 'mlp')."""




@dataclass(frozen=True)
class Layout:
    """The resolved sharding rules for one run: which mesh axes each logical name maps to.

    `params` is the table for fully sharded parameters. The ZeRO stage chooses per tree
    whether the ZeRO axes (`ZERO_AXES`: `fsdp`, and `sequence`, whose devices hold different tokens
    of the same rows) are kept: parameters keep them at stage 3, gradients at stage >= 2, optimizer
    state at stage >= 1; otherwise that tree is replicated over them. The tables are the
    resolved rules (`config.resolved_rules.resolve_rules`: the preset, the config's entries and the
    rules the code adds); a mesh axis may split only one dimension of an array.
    """

    mesh: Mesh
    params: Mapping[str, tuple[str, ...]]
    activations: Mapping[str, tuple[str, ...]]
    zero_stage: int
    rules: ResolvedRules | None = None
    """The resolved rules the tables came from (None for a layout built from tables by hand)."""
    tpu_scatter_paths: bool = False
    """Move gradients into their shards along `scatter_path` (TPU meshes: what libtpu compiles well)."""

    @classmethod
    def from_config(cls, cfg: Config, mesh: Mesh) -> Layout:
        """The layout a config asks for, on a given mesh."""
        rules = resolve_rules(cfg)
        return cls(mesh=mesh, params=rules.params, activations=rules.activations, zero_stage=cfg.parallel.zero_stage,
                   rules=rules, tpu_scatter_paths=mesh.devices.flat[0].platform == "tpu")

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the activation rule `batch` splits the batch over (size-1 axes included)."""
        return self.activations.get("batch", ())

    def activation_spec(self, logical: LogicalSpec, shape: tuple[int, ...] | None = None) -> P:
        """Mesh PartitionSpec for an activation with these logical axes."""
        return self._spec(logical, self.activations, shape, what="activation")

    def param_spec(self, logical: LogicalSpec, shape: tuple[int, ...] | None, *, fsdp: bool,
                   what: str = "parameter") -> P:
        """Mesh PartitionSpec for a parameter-shaped array; `fsdp=False` replicates it over the ZeRO axes."""
        table = self.params if fsdp else {k: tuple(a for a in v if a not in ZERO_AXES) for k, v in self.params.items()}
        return self._spec(logical, table, shape, what=what)

    def scatter_path(self, logical: LogicalSpec, shape: tuple[int, ...], manual: Collection[str] = ()) -> tuple[P, ...]:
        """The layouts a weight's gradient passes through, in order, before it moves into its stored shard.

        Empty: straight into the shard. Only on TPU meshes (`tpu_scatter_paths`), from ZeRO-2, in two cases
        (`manual`: the axes an enclosing shard_map made manual, whose reductions are done by hand):

        - Replica axes: batch axes left to the compiler that the weight is not split over (`expert` for an
          MoE model's dense weights). A gradient split over `fsdp` (N) and replicated over them (M) compiles
          to one all-reduce over both, sliced afterwards: 2 (NM-1)/NM of the gradient. Scattering over
          `fsdp` x replica axes first, then gathering the shard over the replica axes, moves
          (NM-1)/NM + (M-1)/NM: about half. (XLA:CPU compiles the joint reduce-scatter as an all-reduce too,
          so elsewhere the extra gather would only add bytes.)
        - Vocabulary tables (not inside a pipeline stage): libtpu runs a
          reduce-scatter over an fsdp group that spans several torus dimensions as an all-reduce + slice
          (2x the bytes) for some slabs, among them a 128256-wide table scattered on its model dimension,
          but not when the scatter runs along the vocabulary. So the table's gradient is scattered on its
          `vocab` dimension (and gathered over the replica axes there, while it is one shard: from there
          XLA would gather the whole table instead), then moved into the stored layout (an all-to-all).
        """
        if not self.tpu_scatter_paths or self.zero_stage < 2 or self.mesh.shape["fsdp"] == 1:
            return ()
        stored = self.param_spec(logical, None, fsdp=True)
        fsdp_dims = [d for d in range(len(logical)) if "fsdp" in entry_axes(stored, d)]
        if not fsdp_dims:
            return ()
        used = spec_axes(stored)
        replicas = tuple(a for a in self.batch_axes if a not in used and a not in manual and self.mesh.shape[a] > 1)
        target = fsdp_dims[0]
        if "vocab" in logical and "pipeline" not in manual:
            # Inside a pipeline stage the extra layout costs a full buffer (GPipe on v5e:2x4 no longer fits).
            target = list(logical).index("vocab")
        base = [tuple(a for a in entry_axes(stored, d) if a != "fsdp") for d in range(len(logical))]

        def on_target(*axes: str) -> P | None:
            spec = list(base)
            spec[target] = (*spec[target], *axes)
            return None if shape[target] % ways(spec[target], self.mesh.shape) else P(*(a or None for a in spec))

        path = [on_target("fsdp", *replicas)] if replicas else []
        if target not in fsdp_dims:
            path.append(on_target("fsdp"))
        return tuple(spec for spec in path if spec is not None)

    def tree_shardings(self, logical_tree: Any, shape_tree: Any, *, fsdp: bool) -> Any:
        """NamedShardings for a parameter-shaped tree (logical PartitionSpecs beside shapes)."""

        def one(path, logical, shaped):
            spec = self.param_spec(logical, tuple(shaped.shape), fsdp=fsdp, what=jax.tree_util.keystr(path))
            return NamedSharding(self.mesh, spec)

        return jax.tree_util.tree_map_with_path(one, logical_tree, shape_tree, is_leaf=_is_spec)

    def param_shardings(self, logical_tree: Any, shape_tree: Any) -> Any:
        """Shardings of the parameters (split over `fsdp` only at ZeRO stage 3)."""
        return self.tree_shardings(logical_tree, shape_tree, fsdp=self.zero_stage >= 3)

    def grad_shardings(self, logical_tree: Any, shape_tree: Any) -> Any:
        """Shardings of the gradients (split over `fsdp` from ZeRO stage 2)."""
        return self.tree_shardings(logical_tree, shape_tree, fsdp=self.zero_stage >= 2)

    def opt_shardings(self, logical_tree: Any, shape_tree: Any) -> Any:
        """Shardings of parameter-shaped optimizer state (split over `fsdp` from ZeRO stage 1)."""
        return self.tree_shardings(logical_tree, shape_tree, fsdp=self.zero_stage >= 1)

    def batch_sharding(self) -> NamedSharding:
        """Sharding of a [batch, length] token array."""
        return NamedSharding(self.mesh, self.activation_spec(P("batch", None)))

    def _spec(self, logical: LogicalSpec, table: Mapping[str, tuple[str, ...]], shape, what: str) -> P:
        used: dict[str, str] = {}
        out = []
        for dim, name in enumerate(logical):
            if name is not None and name not in LOGICAL_AXES:  # the model code's error, caught by the tests
                raise ValueError(f"{what}: logical axis name {name!r} is not in config.mesh_schema.LOGICAL_AXES")
            axes = tuple(a for a in (table.get(name, ()) if name is not None else ()) if self.mesh.shape[a] > 1)
            for a in axes:
                if a in used:
                    raise ConfigError(
                        f"{what} {tuple(logical)}: mesh axis {a!r} is mapped to both logical axes {used[a]!r} and "
                        f"{name!r}, but it can split only one dimension of an array (change mesh.rules for one "
                        f"of them; `spmd-train describe CONFIG --rules` shows the effective rules)"
                    )
            if shape is not None and axes:
                ways = 1
                for a in axes:
                    ways *= self.mesh.shape[a]
                if shape[dim] % ways:
                    raise ConfigError(
                        f"{what} dimension {dim} ({name!r}, size {shape[dim]}) cannot be split over mesh axes "
                        f"{' x '.join(f'{a}={self.mesh.shape[a]}' for a in axes)} = {ways}: the size must be a "
                        f"multiple of {ways} (change the model dims, the mesh, or mesh.rules for {name!r})"
                    )
            used.update(dict.fromkeys(axes, name))
            out.append(spec_entry(axes))
        while out and out[-1] is None:
            out.pop()
        return P(*out)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)
