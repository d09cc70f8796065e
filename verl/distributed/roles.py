"""Where each role of a job runs, and on what: `Role` (ranks, engine, cpu_offload) and `resolve_roles`, which
turns the config's placement (trainer.placement, each role's `ranks`, `engine`, `cpu_offload`) into checked
roles before any model is built. The dataflow's node configs are built from these (`NodeConfig.from_role`).

    roles = resolve_roles(cfg, world_size)        # {"actor": Role(...), "rollout": ..., "ref", "critic", "reward"}
    roles["rollout"].spec.exclusive              # the engine's capabilities (verl.engines)
"""

from __future__ import annotations

from dataclasses import dataclass

from verl.engines import ROLE_KIND, engine_spec, engines, rollout_engine, training_engine
from verl.errors import VerlConfigError

__all__ = ["Role", "resolve_roles"]


@dataclass(frozen=True, slots=True)
class Role:
    """Where one role of the job runs and on what."""

    name: str
    """actor, rollout, ref, critic or reward."""
    ranks: tuple[int, ...]
    """World ranks, sorted."""
    engine: str
    """Its engine (one of `verl.engines.role_engines(name)`)."""
    cpu_offload: bool
    """Its memory stays on the CPU between its nodes."""

    @property
    def spec(self):
        """Its engine's capabilities (`verl.engines.EngineSpec`)."""
        return engine_spec(ROLE_KIND[self.name], self.engine)


def _ranks(key: str, value, world: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value or \
            not all(isinstance(r, int) and not isinstance(r, bool) for r in value):
        raise VerlConfigError(f"{key}={value!r} must be a non-empty list of ranks, e.g. [0, 1]")
    bad = [r for r in value if not 0 <= r < world]
    if bad:
        raise VerlConfigError(f"{key}={list(value)} names ranks {bad} outside the world of {world} processes "
                              f"(ranks 0..{world - 1}); fix the list or launch more processes")
    if len(set(value)) != len(value):
        raise VerlConfigError(f"{key}={list(value)} names a rank twice")
    return tuple(sorted(value))


def resolve_roles(cfg, world: int) -> dict[str, Role]:
    """Every role's ranks, engine and offload on `world` ranks for the job config `cfg` (a `PPOConfig`): the
    trainer.placement defaults, overridden by each role's `ranks`, then checked (before any model is built)."""
    mode, everyone = cfg.trainer.placement, tuple(range(world))
    if mode == "split" and world < 2:
        raise VerlConfigError(f"trainer.placement=split puts roles on separate ranks and needs at least 2 "
                              f"processes (got {world}); launch with torchrun --nproc_per_node=2 or more, or use "
                              f"trainer.placement=colocated")
    first, second = everyone[:max(1, world // 2)], everyone[max(1, world // 2):] or everyone
    defaults = ({r: everyone for r in ROLE_KIND} if mode == "colocated" else
                {"actor": first, "rollout": first, "ref": first, "critic": second, "reward": second})
    a = cfg.actor
    sections = {"actor": a, "rollout": cfg.rollout, "ref": cfg.ref, "critic": cfg.critic, "reward": cfg.reward}
    roles = {}
    for name, spec in cfg.engine_specs().items():
        ranks, offload, engine = sections[name].ranks, sections[name].cpu_offload, spec.name
        if ranks is None:
            ranks = defaults[name] if name != "ref" else (defaults["ref"] if a.ranks is None else a.ranks)
        ranks = _ranks(f"{name}.ranks", ranks, world)
        if mode == "colocated" and ranks != everyone:
            raise VerlConfigError(f"{name}.ranks={list(ranks)} with trainer.placement=colocated (every role on "
                                  f"every rank); set trainer.placement=split to place roles on their own ranks")
        if offload and not spec.offloadable:
            raise VerlConfigError(f"{name}.cpu_offload=true but its engine {engine!r} cannot offload (engines that "
                                  f"can: {list(engines(ROLE_KIND[name], offloadable=True))}); set "
                                  f"{name}.cpu_offload=false")
        if spec.spans_world and ranks != everyone:
            raise VerlConfigError(f"{name}.ranks={list(ranks)} with the {engine} engine, whose parallel state spans "
                                  f"every rank; give {name} all {world} ranks, or use one of "
                                  f"{list(engines(ROLE_KIND[name], spans_world=False))}")
        roles[name] = Role(name=name, ranks=ranks, engine=engine, cpu_offload=bool(offload))
    holding = (("critic",) if cfg.needs_critic else ()) + (("reward",) if cfg.reward.uses_model else ())
    _check_shared_ranks(roles, mode, holding)
    gen, r = roles["rollout"], cfg.rollout
    # one replica per rank (tp=1) in-process: each rank's engine creates groups over the whole job (seen to hang
    # on CPU); tp > 1 in-process is vLLM's torchrun launcher, which takes the job's ranks by design
    if rollout_engine(gen.engine).in_process_spans_world and r.in_process and r.tp == 1 and gen.ranks != everyone:
        raise VerlConfigError(f"rollout.ranks={list(gen.ranks)} are not all {world} ranks, but rollout.engine="
                              f"{gen.engine} started in the trainer's processes (rollout.in_process=true) creates its "
                              f"process groups over every rank, which the other ranks never join; set "
                              f"rollout.in_process=false (the engine in a process of its own), or give the rollout "
                              f"every rank")
    return roles


def _check_shared_ranks(roles: dict[str, Role], mode: str, holding: tuple[str, ...] = ("critic", "reward")) -> None:
    """`holding`: the roles of the job that hold device memory besides the actor's (a critic only when the
    estimator reads values, a reward only when it is a model)."""
    actor, rollout = roles["actor"], roles["rollout"]
    if 0 not in actor.ranks:
        raise VerlConfigError(f"actor.ranks={list(actor.ranks)} must include rank 0, which logs the metrics and "
                              f"keeps the trainer state")
    shared = set(rollout.ranks) & set(actor.ranks)
    if rollout.ranks != actor.ranks and not training_engine(actor.engine).sends_to_own_ranks:
        raise VerlConfigError(f"rollout.ranks={list(rollout.ranks)} differs from actor.ranks={list(actor.ranks)} with "
                              f"the {actor.engine} actor, whose weights cannot reach a rollout on ranks of its own; "
                              f"use actor.engine= one of {list(engines('training', sends_to_own_ranks=True))} for a "
                              f"rollout on its own ranks, or drop rollout.ranks")
    if rollout.ranks != actor.ranks and shared:
        raise VerlConfigError(f"rollout.ranks={list(rollout.ranks)} partly overlaps actor.ranks={list(actor.ranks)} "
                              f"(shared: {sorted(shared)}); the rollout runs either on the actor's ranks (the same "
                              f"list) or on ranks of its own (disjoint lists, weights sent by the 3D-HybridEngine)")
    if mode == "split" and rollout_engine(rollout.engine).exclusive and not rollout.cpu_offload:
        for other in holding:
            shared = sorted(set(roles[other].ranks) & set(rollout.ranks))
            if shared:
                raise VerlConfigError(f"{other}.ranks={list(roles[other].ranks)} overlaps the {rollout.engine} "
                                      f"rollout on ranks {shared}, which holds its devices' memory; set "
                                      f"rollout.cpu_offload=true (sleep mode frees it while {other} runs), give "
                                      f"{other} other ranks, or use trainer.placement=colocated")
