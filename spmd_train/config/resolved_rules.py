"""The effective sharding rules of a run: the loaded tables plus the rules the code adds, each named.

Pure Python (no jax): `describe --rules`, `config.json` and the layout all read this one record.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from spmd_train.config.mesh_schema import RulesConfig
from spmd_train.config.schema import Config


@dataclass(frozen=True)
class ResolvedRules:
    """Complete logical -> mesh axes tables for activations and parameters, and why the code changed any."""

    activations: dict[str, tuple[str, ...]]
    params: dict[str, tuple[str, ...]]
    """The activation table with the parameter entries on top (`mesh.rules.params`)."""
    added: tuple[str, ...]
    """One line per rule the code added to the configured tables, with the key that asked for it."""

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the activation rule `batch` splits the global batch over."""
        return self.activations.get("batch", ())

    def to_json(self) -> dict:
        """Plain lists, for config.json and `describe --json`."""
        return {"activations": {k: list(v) for k, v in self.activations.items()},
                "params": {k: list(v) for k, v in self.params.items()}, "added_by_code": list(self.added)}


@dataclass(frozen=True)
class RuleTables:
    """The configured tables (a preset with a config's entries on top) before the code adds its rules; hashable, so
    the analytic model can key its caches on them."""

    activations: tuple[tuple[str, tuple[str, ...]], ...]
    params: tuple[tuple[str, tuple[str, ...]], ...]
    """The entries where parameters differ from the activation table."""

    @classmethod
    def from_config(cls, rules: RulesConfig) -> RuleTables:
        """The tables of a loaded `mesh.rules` section."""
        return cls(activations=tuple((k, tuple(v)) for k, v in rules.activations.items()),
                   params=tuple((k, tuple(v)) for k, v in rules.params.items()))

    def resolve(self, *, sequence_parallel: bool, pipeline: int) -> ResolvedRules:
        """The effective tables on a mesh with `pipeline` stages (mesh.pipeline, -1 included): these, with
        Megatron-SP's and the pipeline's rules added where they apply."""
        return _resolve(self, sequence_parallel, pipeline)


def resolve_rules(cfg: Config) -> ResolvedRules:
    """The tables `cfg` asks for, with Megatron-SP's and the pipeline's rules added where they apply."""
    return RuleTables.from_config(cfg.mesh.rules).resolve(sequence_parallel=cfg.parallel.sequence_parallel,
                                                          pipeline=cfg.mesh.pipeline)


@functools.lru_cache(maxsize=256)
def _resolve(tables: RuleTables, sequence_parallel: bool, pipeline: int) -> ResolvedRules:
    acts = dict(tables.activations)
    params = {**acts, **dict(tables.params)}
    added = []
    if sequence_parallel and "tensor" not in acts.get("norm_length", ()):
        acts["norm_length"] = (*acts.get("norm_length", ()), "tensor")
        added.append("activations.norm_length += tensor (parallel.sequence_parallel=true: Megatron-SP splits "
                     "the residual stream's length over the tensor axis)")
    if pipeline != 1 and "pipeline" not in params.get("layers", ()):
        params["layers"] = ("pipeline", *params.get("layers", ()))
        added.append(f"params.layers = pipeline first (mesh.pipeline={pipeline}: each stage owns a contiguous block "
                     "of the layer stack)")
    return ResolvedRules(activations=acts, params=params, added=tuple(added))
