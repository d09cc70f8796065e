"""Upstream verl's config keys as a dialect of ours: one table maps every key of verl's `ppo_trainer.yaml` and
`ppo_megatron_trainer.yaml` (the `actor_rollout_ref.*`, `critic.*`, `reward_model.*`, `algorithm.*`, `data.*`,
`trainer.*`, ... trees) onto this config tree.

    t = translate(["actor_rollout_ref.actor.ppo_mini_batch_size=64", "trainer.total_epochs=3"])
    t.native          # {"actor.mini_batch_size": 64, "trainer.total_epochs": 3, ...}: dotted keys of PPOConfig
    t.refused         # the keys whose value cannot be expressed here, each with the reason

Every verl key is, by its rule in TABLE (first matching pattern wins; `*` is one dotted component, `**` any
number):
- mapped (`map`): onto one or more of our keys, with unit conversions (per-GPU micro-batches, a global
  micro-batch divided by `n_gpus_per_node x nnodes`, `total_epochs`, verl's -1 / null spellings), or
- accepted and ignored (`ignore`) where it has no effect here (memory and speed knobs of verl's engines, Ray,
  profiler settings that only act once a profiler is on), or
- refused (`refuse`) with the reason, unless its value is one with no effect (`ok`: verl's default, e.g.
  `ulysses_sequence_parallel_size=1`); refused values stop the job before anything runs.
A key of neither dialect is an error naming the nearest key of each. `verl compat --keys` prints the table.

A command line or YAML with any verl key is read in this dialect: it starts from verl's defaults (VERL_DEFAULTS,
checked against verl's own YAMLs in tests/compat), not from ours, so a launch script trains what it trains
upstream. Hydra syntax is accepted: `+key=value` / `++key=value`, `--config-name=ppo_megatron_trainer` (verl's
megatron defaults), `${a.b}` / `${oc.select:a.b,default}` / `${oc.env:VAR,default}` interpolations. Keys of our
own dialect may be mixed in; they are applied after the verl keys.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import fnmatch
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from verl.errors import VerlConfigError

__all__ = ["TABLE", "VERL_DEFAULTS", "VERL_MEGATRON_DEFAULTS", "Rule", "Translation", "is_verl_key", "rule_for",
           "translate"]

ROLES = {"actor_rollout_ref.actor": "actor", "actor_rollout_ref.ref": "ref", "critic": "critic"}


class _Refused(Exception):
    """Raised by a conversion: the value cannot be expressed here (the message says why and what is closest)."""


class _Ignored(Exception):
    """Raised by a conversion: at this value (or with these other keys) the key has no effect here."""


@dataclass(frozen=True)
class Rule:
    """How the verl keys matching `pattern` are read."""

    pattern: str
    kind: str
    """map, ignore or refuse."""
    why: str = ""
    """ignore / refuse: the reason; map: what the mapping does (printed by `verl compat --keys`)."""
    convert: Callable[[Any, "_Ctx"], dict[str, Any]] | None = None
    """map: value, context -> {our dotted key: value}; may raise _Refused / _Ignored."""
    ok: Callable[[Any, "_Ctx"], bool] | None = None
    """refuse: values accepted because they have no effect here."""

    def matches(self, key: str) -> bool:
        return _match(tuple(self.pattern.split(".")), tuple(key.split(".")))


def _match(pat: tuple[str, ...], key: tuple[str, ...]) -> bool:
    if not pat:
        return not key
    if pat[0] == "**":
        return any(_match(pat[1:], key[i:]) for i in range(len(key) + 1))
    return bool(key) and fnmatch.fnmatchcase(key[0], pat[0]) and _match(pat[1:], key[1:])


# ---------------------------------------------------------------------------------------------- values

def _none(v) -> bool:
    return v is None or (isinstance(v, str) and v.strip().lower() in ("null", "none", "~", ""))


def _int(v, key: str = "") -> int:
    try:
        return int(float(v)) if not isinstance(v, bool) else int(v)
    except (TypeError, ValueError):
        raise _Refused(f"expected an integer, got {v!r}") from None


def _float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise _Refused(f"expected a number, got {v!r}") from None


def _bool(v) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0", "yes", "no"):
        return v.lower() in ("true", "1", "yes")
    if isinstance(v, int):
        return bool(v)
    raise _Refused(f"expected true/false, got {v!r}")


def _files(v) -> list[str]:
    items = [v] if isinstance(v, str) else list(v or [])
    return [os.path.expanduser(str(x)) for x in items if not _none(x)]


_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "half": "float16",
           "fp32": "float32", "float32": "float32", "float": "float32"}


def _dtype(v) -> str:
    if str(v) not in _DTYPES:
        raise _Refused(f"dtype {v!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[str(v)]


# ---------------------------------------------------------------------------------------------- context

class _Ctx:
    """The whole verl-side config being translated (user values over verl's defaults), for rules that read
    other keys."""

    def __init__(self, flat: dict[str, Any]):
        self.flat = flat
        self.notes: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        if key in self.flat:
            return self.flat[key]
        return VERL_DEFAULTS.get(key, default)

    @property
    def world(self) -> int:
        return max(1, _int(self.get("trainer.n_gpus_per_node", 8))) * max(1, _int(self.get("trainer.nnodes", 1)))

    @property
    def loss_mode(self) -> str:
        return str(self.get("actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla"))

    @property
    def uses_critic(self) -> bool:
        return str(self.get("algorithm.adv_estimator", "gae")) == "gae"

    @property
    def uses_ref(self) -> bool:
        return _bool(self.get("actor_rollout_ref.actor.use_kl_loss", False)) or \
            _bool(self.get("algorithm.use_kl_in_reward", False))

    @property
    def uses_reward_model(self) -> bool:
        return _bool(self.get("reward_model.enable", False))


# ---------------------------------------------------------------------------------------------- rule makers

def to(*targets: str, conv: Callable[[Any], Any] | None = None) -> Callable:
    """A map whose value (converted by `conv`) goes to every key of `targets`; verl's null leaves ours as is."""
    def convert(v, ctx):
        if _none(v):
            return {}
        value = conv(v) if conv is not None else v
        return {t: value for t in targets}
    convert.targets = targets
    return convert


def M(pattern: str, convert: Callable, why: str = "") -> Rule:
    if not why and hasattr(convert, "targets"):
        why = "-> " + ", ".join(convert.targets)
    return Rule(pattern, "map", why, convert)


def I(pattern: str, why: str) -> Rule:  # noqa: E743 - the table reads as M / I / R
    return Rule(pattern, "ignore", why)


def R(pattern: str, why: str, ok: Callable[[Any, _Ctx], bool] | tuple = ()) -> Rule:
    if isinstance(ok, tuple):
        values = ok
        ok = (lambda v, ctx, values=values: (_none(v) and None in values) or
              any(not _none(v) and str(v).lower() == str(x).lower() for x in values if x is not None))
    return Rule(pattern, "refuse", why, ok=ok)


def Dep(pattern: str, feature: str, off: tuple, why: str) -> Rule:
    """A key that only parametrises a refused feature (`feature`, a full key, off at the values `off`): refused
    with the feature, accepted while the feature is off (then it has no effect)."""
    def ok(v, ctx):
        value = ctx.get(feature)
        return (_none(value) and None in off) or any(str(value).lower() == str(x).lower() for x in off
                                                     if x is not None)
    return Rule(pattern, "refuse", f"{why} (it parametrises {feature}, which is not supported)", ok=ok)


def Via(pattern: str, reader: str) -> Rule:
    """A key whose value another key's mapping reads (`reader`): mapped there."""
    return Rule(pattern, "map", f"read by the mapping of {reader}", lambda v, ctx: {})


def _noop_dict(v, ctx) -> bool:
    return _none(v) or v == {} or v == []


# ---------------------------------------------------------------------------------------------- conversions

def _strategy(role: str):
    def convert(v, ctx):
        engines = {"fsdp": "fsdp", "fsdp2": "fsdp", "megatron": "megatron"}
        if str(v) not in engines:
            raise _Refused(f"strategy {v!r} has no engine here (fsdp, fsdp2 -> fsdp; megatron)")
        return {f"{role}.engine": engines[str(v)]}
    return convert


def _micro_per_gpu(role: str):
    return to(f"{role}.micro_batch_size", conv=int)


def _micro_global(role: str):
    def convert(v, ctx):
        if _none(v):
            return {}
        return {f"{role}.micro_batch_size": max(1, _int(v) // ctx.world)}
    return convert


def _dynamic_bsz(prefix: str, role: str):
    """use_dynamic_bsz=True: token-budget micro-batches of ppo_max_token_len_per_gpu tokens."""
    def convert(v, ctx):
        if not _bool(v):
            return {f"{role}.max_tokens_per_micro_batch": 0}
        return {f"{role}.max_tokens_per_micro_batch": _int(ctx.get(f"{prefix}.ppo_max_token_len_per_gpu", 16384))}
    return convert


def _clip(which: str):
    def convert(v, ctx):
        value = ctx.get("actor_rollout_ref.actor.clip_ratio", 0.2) if _none(v) else v
        return {f"actor.clip_ratio_{which}": _float(value)}
    return convert


def _clip_ratio(v, ctx):
    lo, hi = (ctx.get(f"actor_rollout_ref.actor.clip_ratio_{w}") for w in ("low", "high"))
    if not _none(lo) and not _none(hi):
        raise _Ignored("clip_ratio_low and clip_ratio_high are both set (verl reads clip_ratio only for a null one)")
    return {}


def _loss_param(loss: str, name: str):
    def convert(v, ctx):
        if ctx.loss_mode != loss:
            raise _Ignored(f"read only by policy_loss.loss_mode={loss}")
        return {f"actor.policy_loss_params.{name}": _float(v)}
    return convert


_VERL_ESTIMATORS = {"rloo_vectorized": "rloo", "grpo_vectorized": "grpo"}
_NO_ESTIMATOR = ("optimal_token_baseline", "tir_optimal_token_baseline", "gdpo")


def _estimator(v, ctx):
    name = str(v)
    if name in _NO_ESTIMATOR:
        raise _Refused(f"advantage estimator {name!r} is not implemented here (see `verl algos`: gae, grpo, "
                       f"dr_grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, opo, gpg, "
                       f"grpo_passk)")
    return {"algorithm.adv_estimator": _VERL_ESTIMATORS.get(name, name)}


def _kl_name(target: str):
    def convert(v, ctx):
        if str(v) == "full":
            raise _Refused("the 'full' KL (over the whole vocabulary) is not implemented; the closest is "
                           "low_var_kl (k3)")
        return {target: str(v)}
    return convert


def _loss_mode(v, ctx):
    if str(v) == "bypass_mode":
        raise _Refused("bypass_mode is algorithm.rollout_correction.bypass_mode here, not a loss")
    return {"actor.policy_loss": str(v)}


def _offload(role: str, fsdp: bool = True):
    def convert(v, ctx):
        return {f"{role}.cpu_offload": True} if _bool(v) else {}
    return convert


def _megatron_same(actor_key: str):
    """ref / critic megatron layout: shared with the actor's here, so it must equal it."""
    def ok(v, ctx):
        return str(v) == str(ctx.get(actor_key))
    return ok


def _sequence_parallel(v, ctx):
    tp = _int(ctx.get("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", 1))
    return {"actor.megatron.sequence_parallel": _bool(v) and tp > 1}  # verl turns it off at tp=1 too


def _total_steps(v, ctx):
    if _none(v):
        return {}
    return {"trainer.total_steps": _int(v), "trainer.total_epochs": 0}


def _total_epochs(v, ctx):
    if not _none(ctx.get("trainer.total_training_steps")):
        raise _Ignored("trainer.total_training_steps is set, which verl lets decide the run's length")
    return {"trainer.total_epochs": _int(v)}


def _save_freq(v, ctx):
    every = _int(v)
    return {"trainer.save_every": every, "trainer.save_final": True} if every > 0 else \
        {"trainer.save_every": 0, "trainer.save_final": False}


def _resume(v, ctx):
    mode = str(v)
    if mode == "auto":
        return {"trainer.resume": "auto"}
    if mode == "disable":
        return {"trainer.resume": None}
    if mode == "resume_path":
        path = ctx.get("trainer.resume_from_path")
        if _none(path):
            raise _Refused("resume_mode=resume_path needs trainer.resume_from_path")
        return {"trainer.resume": os.path.expanduser(str(path))}
    raise _Refused(f"resume_mode {mode!r} is not auto, disable or resume_path")


_SINKS = ("console", "tensorboard")


def _logger(v, ctx):
    sinks = [v] if isinstance(v, str) else list(v or [])
    other = [s for s in sinks if s not in _SINKS]
    if other:
        ctx.notes.append(f"trainer.logger: {', '.join(map(str, other))} are not metric sinks here; metrics go to "
                      f"<output_dir>/metrics.jsonl and TensorBoard")
    return {"trainer.progress_bar": "console" in sinks}


def _device(v, ctx):
    if str(v) == "npu":
        raise _Refused("Ascend NPUs are not supported; use cuda or cpu")
    if str(v) == "cuda":
        ctx.notes.append("trainer.device=cuda -> auto (cuda when a GPU is visible, else the CPU)")
        return {"trainer.device": "auto"}
    return {"trainer.device": str(v)}


def _val_temperature(v, ctx):
    greedy = not _bool(ctx.get("actor_rollout_ref.rollout.val_kwargs.do_sample", False))
    return {"val.temperature": 0.0 if greedy else _float(v)}


def _top_k(target: str):
    return to(target, conv=lambda v: max(0, int(v)))


def _truncation(v, ctx):
    if str(v) != "error" and not _bool(ctx.get("data.filter_overlong_prompts", False)):
        ctx.notes.append(f"data.truncation={v}: prompts are never cut here; one longer than data.max_prompt_length "
                      f"stops the job before training (data.filter_overlong_prompts=True drops them)")
    return {}


def _rollout_name(v, ctx):
    names = {"vllm": "vllm", "sglang": "sglang", "hf": "hf", "torch": "torch"}
    if str(v) == "???":  # Hydra's mandatory marker left unset: our default engine
        return {}
    if str(v) not in names:
        raise _Refused(f"rollout engine {v!r} is not available here; engines: vllm, sglang, hf, torch")
    return {"rollout.engine": names[str(v)]}


def _is_level(v, ctx):
    if _none(v):
        return {"algorithm.rollout_correction.is_level": "none"}
    if str(v) not in ("token", "sequence"):
        raise _Refused(f"rollout_is={v!r}: IS weights are per token or per sequence here")
    return {"algorithm.rollout_correction.is_level": str(v)}


_RS = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric",
       "token": "token", "sequence": "sequence", "geometric": "geometric"}


def _rs_level(v, ctx):
    if _none(v):
        return {"algorithm.rollout_correction.rejection_level": "none"}
    if str(v) not in _RS:
        raise _Refused(f"rollout_rs={v!r}: rejection here is on the ratio per token (token_k1), on the sequence's "
                       f"product (seq_sum_k1) or its geometric mean (seq_mean_k1); k2 / k3 / max modes are not")
    out = {"algorithm.rollout_correction.rejection_level": _RS[str(v)]}
    threshold = ctx.get("algorithm.rollout_correction.rollout_rs_threshold")
    if not _none(threshold):
        lo, sep, hi = str(threshold).partition("_")
        upper = _float(hi if sep else lo)
        out.update({"algorithm.rollout_correction.rejection_upper": upper,
                    "algorithm.rollout_correction.rejection_lower": _float(lo) if sep else 1.0 / upper})
    return out


def _critic_path(v, ctx):
    actor = ctx.get("actor_rollout_ref.model.path")
    same = (_none(v) and _none(actor)) or (not _none(v) and not _none(actor) and
                                           os.path.expanduser(str(v)) == os.path.expanduser(str(actor)))
    if not same:
        raise _Refused(f"the critic starts from the policy's own weights (plus a value head) here; a critic "
                       f"from another model ({v!r}, the actor's is {actor!r}) is not supported: set "
                       f"critic.model.path to actor_rollout_ref.model.path")
    return {}


def _custom_reward(v, ctx):
    name = ctx.get("custom_reward_function.name", "compute_score")
    return {"reward.name": f"{os.path.expanduser(str(v))}:{name}"}


def _reward_manager(v, ctx):
    kind = str(v)
    if kind not in ("naive", "batch", "dapo"):
        raise _Refused(f"reward manager {kind!r} is not available here (naive, batch: the function's own "
                       f"signature decides; dapo: with reward_model.reward_kwargs.overlong_buffer_cfg)")
    return {}


def _overlong(v, ctx):
    if str(ctx.get("reward_model.reward_manager", "naive")) != "dapo" or \
            not _bool(ctx.get("reward_model.reward_kwargs.overlong_buffer_cfg.enable", False)):
        raise _Ignored("read only by the dapo reward manager with overlong_buffer_cfg.enable=True")
    return {"reward.overlong_buffer": _int(v)}


def _overlong_factor(v, ctx):
    _overlong(v, ctx)
    return {"reward.overlong_penalty_factor": _float(v)}


def _max_resp_len(v, ctx):
    limit = ctx.get("data.max_response_length", 512)
    if _int(v) != _int(limit):
        raise _Refused(f"max_resp_len={v} differs from data.max_response_length={limit}; the overlong buffer is "
                       f"placed at the response limit here")
    return {}


def _reward_model_enable(v, ctx):
    if not _bool(v):
        return {}
    path = ctx.get("reward_model.model.path")
    return {"reward.type": "model", "reward.model_path": os.path.expanduser(str(path))}


def _model_override(v, ctx):
    if not _none(ctx.get("actor_rollout_ref.model.path")):
        raise _Refused("overriding a Hugging Face model's config is not supported; the model's own "
                       "max_position_embeddings applies (rollout.max_model_len caps it)")
    return {"model.tiny.max_position_embeddings": _int(v)}


def _remove_padding(role: str):
    prefix = "actor_rollout_ref.actor" if role == "actor" else "critic"

    def convert(v, ctx):
        if str(ctx.get(f"{prefix}.strategy")) == "megatron":
            raise _Ignored(f"a megatron {role} reads {prefix}.megatron.use_remove_padding")
        return {f"{role}.padding_free": _bool(v)}
    return convert


def _lr_style(v, ctx):
    style = {"constant": "constant", "cosine": "cosine", "linear": "linear"}.get(str(v))
    if style is None:
        raise _Refused(f"learning-rate schedule {v!r} is not one of constant, cosine, linear")
    return style


def _optim(role: str, prefix: str) -> list[Rule]:
    """The optimizer keys of one role (verl's FSDP and megatron optimizer configs)."""
    o = f"{role}.optim"
    return [
        M(f"{prefix}.optim.lr", to(f"{o}.lr", conv=float)),
        M(f"{prefix}.optim.weight_decay", to(f"{o}.weight_decay", conv=float)),
        M(f"{prefix}.optim.betas", to(f"{o}.betas", conv=lambda v: [float(x) for x in v])),
        M(f"{prefix}.optim.clip_grad", to(f"{o}.grad_clip", conv=float)),
        M(f"{prefix}.grad_clip", to(f"{o}.grad_clip", conv=float)),
        M(f"{prefix}.optim.lr_warmup_steps", lambda v, ctx: {} if _none(v) or _int(v) < 0 else
          {f"{o}.warmup_steps": _int(v)}, f"-> {o}.warmup_steps (-1: the ratio decides)"),
        M(f"{prefix}.optim.lr_warmup_steps_ratio", to(f"{o}.warmup_ratio", conv=float)),
        M(f"{prefix}.optim.lr_scheduler_type", lambda v, ctx: {f"{o}.lr_decay_style": _lr_style(v, ctx)},
          f"-> {o}.lr_decay_style"),
        M(f"{prefix}.optim.warmup_style", lambda v, ctx: {} if _none(v) else {f"{o}.lr_decay_style":
                                                                               _lr_style(v, ctx)},
          f"-> {o}.lr_decay_style (deprecated spelling)"),
        M(f"{prefix}.optim.lr_decay_style", lambda v, ctx: {f"{o}.lr_decay_style": _lr_style(v, ctx)},
          f"-> {o}.lr_decay_style"),
        M(f"{prefix}.optim.min_lr_ratio", lambda v, ctx: {} if _none(v) else {f"{o}.min_lr": _float(v) * _float(
            ctx.get(f"{prefix}.optim.lr", 1e-6))}, f"-> {o}.min_lr = min_lr_ratio x lr"),
        M(f"{prefix}.optim.min_lr", to(f"{o}.min_lr", conv=float)),
        R(f"{prefix}.optim.num_cycles", "cosine cycles other than one half-period are not supported", (0.5,)),
        R(f"{prefix}.optim.optimizer", "the optimizer here is AdamW (megatron's 'adam' decouples weight decay "
          "too)", ("AdamW", "adam", "adamw")),
        R(f"{prefix}.optim.optimizer_impl", "the optimizer here is torch.optim.AdamW", ("torch.optim",)),
        R(f"{prefix}.optim.override_optimizer_config", "optimizer constructor overrides are not supported",
          _noop_dict),
        I(f"{prefix}.optim.total_training_steps", "filled in by verl's trainer; here from the run's length"),
        R(f"{prefix}.optim.lr_decay_steps", "the decay spans the run's remaining steps here", (None,)),
        R(f"{prefix}.optim.lr_warmup_init", "warm-up starts from lr / warmup_steps here", (0, 0.0)),
        Dep(f"{prefix}.optim.lr_wsd_*", f"{prefix}.optim.lr_decay_style", ("constant", "linear", "cosine", None),
            "the WSD schedule's setting"),
        I(f"{prefix}.optim.use_checkpoint_opt_param_scheduler", "the schedule's state is always in checkpoints"),
        R(f"{prefix}.optim.weight_decay_incr_style", "weight decay is constant here", ("constant",)),
        I(f"{prefix}.optim._target_", "Hydra's class marker"),
    ]


_MEMORY = "memory / speed only: it does not change what is computed"
_RAY = "Ray is not used here (torchrun starts the processes)"


def _fsdp(prefix: str, role: str) -> list[Rule]:
    """verl's fsdp_config of one role (`prefix`: its fsdp_config node)."""
    f = f"{role}.fsdp"
    return [
        M(f"{prefix}.param_offload", _offload(role), f"-> {role}.cpu_offload (true turns it on)"),
        M(f"{prefix}.optimizer_offload", _offload(role), f"-> {role}.cpu_offload (true turns it on)"),
        M(f"{prefix}.offload_policy", _offload(role), f"-> {role}.cpu_offload (true turns it on)"),
        M(f"{prefix}.fsdp_size", to(f"{f}.shard_size", conv=int)),
        M(f"{prefix}.reshard_after_forward", to(f"{f}.reshard_after_forward", conv=_bool)),
        M(f"{prefix}.dtype", to(f"{f}.param_dtype", conv=_dtype)),
        M(f"{prefix}.model_dtype", to("model.dtype", conv=_dtype) if role == "actor" else
          lambda v, ctx: {}, "-> model.dtype (the master weights' dtype)"),
        M(f"{prefix}.strategy", _strategy(role), f"-> {role}.engine"),
        R(f"{prefix}.ulysses_sequence_parallel_size", "Ulysses sequence parallelism is not implemented here (the "
          "megatron engine's sequence_parallel is the one there is)", (1,)),
        R(f"{prefix}.full_determinism", "deterministic kernels are not forced here", (False,)),
        I(f"{prefix}.wrap_policy.**", "FSDP2 wraps one unit per decoder layer here; the wrapping changes memory "
          "only"),
        I(f"{prefix}.forward_prefetch", _MEMORY),
        I(f"{prefix}.use_orig_params", "FSDP1's flat-parameter switch; FSDP2 has none"),
        I(f"{prefix}.use_torch_compile", _MEMORY),
        I(f"{prefix}.entropy_from_logits_with_chunking", _MEMORY),
        I(f"{prefix}.entropy_checkpointing", _MEMORY),
        I(f"{prefix}.forward_only", "set by verl for the reference; a frozen engine here needs no switch"),
        I(f"{prefix}.seed", "initialisation is seeded by trainer.seed"),
        I(f"{prefix}.mixed_precision.**", "the dtypes are fsdp_config.dtype / model_dtype"),
        I(f"{prefix}._target_", "Hydra's class marker"),
    ]


def _megatron(prefix: str, role: str) -> list[Rule]:
    """verl's megatron config of one role; ours is one layout shared by the actor, reference and critic."""
    a = "actor_rollout_ref.actor.megatron"
    if role != "actor":
        same = (f"the {role} shares the actor's megatron layout here; a layout changes memory and speed, not "
                f"results")
        rules = [I(f"{prefix}.{k}", same) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                     "sequence_parallel", "use_distributed_optimizer")]
        rules += [R(f"{prefix}.dtype", f"the {role} shares the actor's megatron dtype here",
                    _megatron_same(f"{a}.dtype"))]
        rules += [R(f"{prefix}.{k}", f"{k} is not supported", ok) for k, ok in (
            ("context_parallel_size", (1,)), ("expert_model_parallel_size", (1,)),
            ("expert_tensor_parallel_size", (None, 1)), ("virtual_pipeline_model_parallel_size", (None, 1)))]
    else:
        m = "actor.megatron"
        rules = [M(f"{prefix}.tensor_model_parallel_size", to(f"{m}.tp", conv=int)),
                 M(f"{prefix}.pipeline_model_parallel_size", to(f"{m}.pp", conv=int)),
                 M(f"{prefix}.sequence_parallel", _sequence_parallel, f"-> {m}.sequence_parallel (off at tp=1, "
                   f"as verl does)"),
                 M(f"{prefix}.use_distributed_optimizer", to(f"{m}.use_distributed_optimizer", conv=_bool)),
                 M(f"{prefix}.dtype", to(f"{m}.params_dtype", "model.dtype", conv=_dtype),
                   f"-> {m}.params_dtype, model.dtype (the policy every engine starts from)"),
                 R(f"{prefix}.context_parallel_size", "context parallelism is not implemented here", (1,)),
                 R(f"{prefix}.expert_model_parallel_size", "expert parallelism is not implemented here", (1,)),
                 R(f"{prefix}.expert_tensor_parallel_size", "expert parallelism is not implemented here",
                   (None, 1)),
                 R(f"{prefix}.virtual_pipeline_model_parallel_size", "interleaved (virtual) pipelines are not "
                   "implemented here", (None, 1))]
    return rules + [
        R(f"{prefix}.param_offload", "megatron keeps its layout on the device here (no CPU offload)", (False,)),
        R(f"{prefix}.grad_offload", "megatron keeps its layout on the device here (no CPU offload)", (False,)),
        R(f"{prefix}.optimizer_offload", "megatron keeps its layout on the device here (no CPU offload)", (False,)),
        M(f"{prefix}.use_remove_padding", to(f"{role}.padding_free", conv=_bool) if role != "ref" else
          lambda v, ctx: {}, "-> padding_free (the reference follows the actor's)"),
        R(f"{prefix}.use_dist_checkpointing", "checkpoints are torch.distributed.checkpoint here; loading megatron "
          "dist checkpoints is not supported", (False,)),
        Dep(f"{prefix}.dist_checkpointing_path", f"{prefix}.use_dist_checkpointing", (False, None),
            "where dist checkpoints are"),
        Dep(f"{prefix}.dist_checkpointing_prefix", f"{prefix}.use_dist_checkpointing", (False, None),
            "dist checkpoints' prefix"),
        I(f"{prefix}.use_mbridge", "Hugging Face weights are converted by verl's own converters here"),
        I(f"{prefix}.vanilla_mbridge", "Hugging Face weights are converted by verl's own converters here"),
        I(f"{prefix}.seed", "initialisation is seeded by trainer.seed"),
        I(f"{prefix}.forward_only", "set by verl for the reference; a frozen engine here needs no switch"),
        I(f"{prefix}.override_transformer_config.recompute_*", _MEMORY),
        I(f"{prefix}.override_transformer_config.attention_backend", "the attention kernel: " + _MEMORY),
        R(f"{prefix}.override_transformer_config", "overriding megatron's TransformerConfig is not supported",
          lambda v, ctx: _noop_dict(v, ctx) or isinstance(v, dict)),
        R(f"{prefix}.override_transformer_config.**", "overriding megatron's TransformerConfig is not supported",
          (None,)),
        R(f"{prefix}.override_ddp_config", "overriding megatron's DDP config is not supported", _noop_dict),
        R(f"{prefix}.override_ddp_config.**", "overriding megatron's DDP config is not supported", ()),
        R(f"{prefix}.override_mcore_model_config", "overriding megatron's model config is not supported",
          _noop_dict),
        R(f"{prefix}.override_mcore_model_config.**", "overriding megatron's model config is not supported", ()),
        I(f"{prefix}._target_", "Hydra's class marker"),
    ]


def _model(prefix: str, role: str) -> list[Rule]:
    """verl's model node of the actor (actor_rollout_ref.model) or the critic (critic.model)."""
    actor = role == "actor"
    lora = "LoRA is not part of this dialect's mapping: train the full model, or see docs/from_verl.md"
    return [
        M(f"{prefix}.path", to("model.path", conv=lambda v: os.path.expanduser(str(v))) if actor else _critic_path,
          "-> model.path (null: the embedded tiny model)" if actor else "the critic starts from the policy: must "
          "equal actor_rollout_ref.model.path"),
        R(f"{prefix}.tokenizer_path", "the tokenizer is read from the model directory",
          lambda v, ctx: _none(v) or str(v) == str(ctx.get("actor_rollout_ref.model.path"))),
        R(f"{prefix}.hf_config_path", "the Hugging Face config is read from the model directory", (None,)),
        R(f"{prefix}.custom_chat_template", "the model's own chat template renders chat prompts", (None,)),
        R(f"{prefix}.trust_remote_code", "code shipped with a model is not run here", (False,)),
        R(f"{prefix}.external_lib", "importing a library to register model classes is not supported", (None,)),
        M(f"{prefix}.override_config.max_position_embeddings", _model_override,
          "-> model.tiny.max_position_embeddings (the embedded tiny model; refused for a Hugging Face model)"),
        R(f"{prefix}.override_config", "overriding a Hugging Face model's config is not supported", _noop_dict),
        R(f"{prefix}.override_config.model_config", "overriding a model's config is not supported", _noop_dict),
        R(f"{prefix}.override_config.moe_config.freeze_moe_router", "a frozen MoE router is not supported",
          (False,)),
        R(f"{prefix}.override_config.**", "overriding a Hugging Face model's config is not supported", ()),
        M(f"{prefix}.use_remove_padding", _remove_padding(role), f"-> {role}.padding_free (a megatron "
          f"{role} reads megatron.use_remove_padding)"),
        M(f"{prefix}.use_fused_kernels", to("actor.fused_loss_head", conv=_bool) if actor else lambda v, ctx: {},
          "-> actor.fused_loss_head (the critic has no loss head)"),
        I(f"{prefix}.fused_kernel_options.**", "verl's fused loss head has one implementation here"),
        I(f"{prefix}.enable_gradient_checkpointing", _MEMORY),
        I(f"{prefix}.enable_activation_offload", _MEMORY),
        I(f"{prefix}.use_liger", "Liger kernels: " + _MEMORY + " (verl's own fused kernels run here)"),
        I(f"{prefix}.use_shm", "a shared-memory copy of the model files: loading speed only"),
        I(f"{prefix}.tiled_mlp.**", _MEMORY),
        R(f"{prefix}.lora_rank", lora, (0,)),
        R(f"{prefix}.lora.rank", lora, (0,)),
        R(f"{prefix}.lora_adapter_path", lora, (None,)),
        R(f"{prefix}.lora.adapter_path", lora, (None,)),
        Dep(f"{prefix}.lora_alpha", f"{prefix}.lora_rank", (0, None), "LoRA's alpha"),
        Dep(f"{prefix}.target_modules", f"{prefix}.lora_rank", (0, None), "LoRA's target modules"),
        Dep(f"{prefix}.exclude_modules", f"{prefix}.lora_rank", (0, None), "LoRA's excluded modules"),
        Dep(f"{prefix}.lora.**", f"{prefix}.lora.rank", (0, None), "a LoRA setting"),
        R(f"{prefix}.mtp.enable", "multi-token prediction is not implemented here", (False,)),
        R(f"{prefix}.mtp.enable_train", "multi-token prediction is not implemented here", (False,)),
        R(f"{prefix}.mtp.enable_rollout", "multi-token prediction is not implemented here", (False,)),
        Dep(f"{prefix}.mtp.**", f"{prefix}.mtp.enable", (False, None), "a multi-token-prediction setting"),
        I(f"{prefix}.fsdp_config._target_", "Hydra's class marker"),
        *(_fsdp(f"{prefix}.fsdp_config", role) if not actor else []),
        I(f"{prefix}._target_", "Hydra's class marker"),
    ]


def _checkpoint_profiler(prefix: str) -> list[Rule]:
    return [
        I(f"{prefix}.checkpoint.save_contents", "a checkpoint here always holds the model, optimizer and trainer "
          "state; trainer.export_hf writes the final Hugging Face model"),
        I(f"{prefix}.checkpoint.load_contents", "a checkpoint is always restored whole"),
        R(f"{prefix}.checkpoint.async_save", "checkpoints are written synchronously here", (False,)),
        I(f"{prefix}.checkpoint._target_", "Hydra's class marker"),
        R(f"{prefix}.profiler.enable", "verl's profiler integration is not available; trainer.trace_step writes "
          "a Chrome trace of one step", (False, None)),
        Dep(f"{prefix}.profiler.**", f"{prefix}.profiler.enable", (False, None), "a profiler setting"),
    ]


def _log_prob_passes(prefix: str) -> list[Rule]:
    why = ("the log-prob passes use the actor's micro-batching here; micro-batches change memory, not results "
           "(losses and log-probs are computed per token)")
    return [I(f"{prefix}.log_prob_micro_batch_size", why), I(f"{prefix}.log_prob_micro_batch_size_per_gpu", why),
            I(f"{prefix}.log_prob_use_dynamic_bsz", why), I(f"{prefix}.log_prob_max_token_len_per_gpu", why)]


_A, _R, _O = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "actor_rollout_ref.rollout"

_DATA: list[Rule] = [
    M("data.train_files", to("data.train_files", conv=_files)),
    M("data.val_files", to("data.val_files", conv=_files)),
    M("data.prompt_key", to("data.prompt_key", conv=str)),
    M("data.reward_fn_key", to("data.data_source_key", conv=str)),
    M("data.max_prompt_length", to("data.max_prompt_length", conv=int)),
    M("data.max_response_length", to("rollout.max_new_tokens", conv=int)),
    M("data.train_batch_size", to("data.train_batch_size", conv=int)),
    M("data.val_batch_size", to("val.batch_size", conv=int)),
    M("data.train_max_samples", to("data.train_max_samples", conv=int)),
    M("data.val_max_samples", to("data.val_max_samples", conv=int)),
    M("data.shuffle", to("data.shuffle", conv=_bool)),
    M("data.seed", to("trainer.seed", conv=int), "-> trainer.seed (which seeds the data order here)"),
    M("data.filter_overlong_prompts", lambda v, ctx: {"data.overlong_prompts": "filter" if _bool(v) else "error"},
      "-> data.overlong_prompts (filter / error)"),
    M("data.truncation", _truncation, "prompts are never cut here: too long is an error (or filtered)"),
    I("data.filter_overlong_prompts_workers", "prompts are measured in the main process"),
    I("data.dataloader_num_workers", "prompt rows are read in the main process"),
    I("data.use_shm", "a shared-memory copy of the files: loading speed only"),
    I("data.return_raw_input_ids", "what verl's dataset hands its workers; prompts travel as the file holds them "
      "and the rollout engine encodes them"),
    I("data.return_raw_chat", "what verl's dataset hands its workers; chat prompts are rendered by the model's "
      "chat template here"),
    I("data.return_full_prompt", "what verl's dataset hands its workers"),
    I("data.validation_shuffle", "the whole held-out set is evaluated; its order does not change the metrics"),
    I("data.image_key", "text only: rows with images are refused when the data is read"),
    I("data.video_key", "text only: rows with videos are refused when the data is read"),
    I("data.image_patch_size", "text only: rows with images are refused when the data is read"),
    I("data.return_multi_modal_inputs", "text only: rows with images are refused when the data is read"),
    R("data.tokenizer", "the tokenizer is the model's own", (None,)),
    R("data.trust_remote_code", "code shipped with a tokenizer is not run here", (False,)),
    R("data.custom_cls.path", "a custom dataset class is verl's Python API; write the rows as parquet / JSONL in "
      "verl's layout instead", (None,)),
    Dep("data.custom_cls.name", "data.custom_cls.path", (None,), "the custom dataset class's name"),
    R("data.datagen.path", "dynamic data generation is not supported", (None,)),
    Dep("data.datagen.name", "data.datagen.path", (None,), "the data generator's name"),
    R("data.sampler.class_path", "custom (curriculum) samplers are not supported; data.shuffle orders the rows",
      (None,)),
    Dep("data.sampler.class_name", "data.sampler.class_path", (None,), "the sampler's class name"),
    R("data.apply_chat_template_kwargs", "arguments to the chat template are not supported", _noop_dict),
    R("data.apply_chat_template_kwargs.**", "arguments to the chat template are not supported", ()),
    R("data.tool_config_path", "multi-turn tools are verl.agents here (docs/ARCHITECTURE.md)", (None,)),
]

_ACTOR: list[Rule] = [
    M(f"{_A}.strategy", _strategy("actor"), "-> actor.engine (fsdp, fsdp2 -> fsdp; megatron)"),
    M(f"{_A}.ppo_mini_batch_size", to("actor.mini_batch_size", conv=int), "-> actor.mini_batch_size (prompts)"),
    M(f"{_A}.ppo_micro_batch_size_per_gpu", _micro_per_gpu("actor"), "-> actor.micro_batch_size (responses "
      "per rank)"),
    M(f"{_A}.ppo_micro_batch_size", _micro_global("actor"), "-> actor.micro_batch_size = value / (n_gpus_per_node "
      "x nnodes)"),
    M(f"{_A}.use_dynamic_bsz", _dynamic_bsz(_A, "actor"), "-> actor.max_tokens_per_micro_batch = "
      "ppo_max_token_len_per_gpu when true"),
    Via(f"{_A}.ppo_max_token_len_per_gpu", f"{_A}.use_dynamic_bsz"),
    M(f"{_A}.ppo_epochs", to("actor.ppo_epochs", conv=int)),
    R(f"{_A}.shuffle", "mini-batches are taken in generation order here", (False,)),
    Dep(f"{_A}.data_loader_seed", f"{_A}.shuffle", (False, None), "the shuffle's seed"),
    M(f"{_A}.clip_ratio", _clip_ratio, "the default of clip_ratio_low / high when they are null"),
    M(f"{_A}.clip_ratio_low", _clip("low"), "-> actor.clip_ratio_low (cispo, dppo_*, geo_mean read it too, as "
      "verl does)"),
    M(f"{_A}.clip_ratio_high", _clip("high"), "-> actor.clip_ratio_high"),
    M(f"{_A}.clip_ratio_c", to("actor.clip_ratio_c", conv=float), "-> actor.clip_ratio_c (dual clip; dppo_*'s "
      "truncation)"),
    M(f"{_A}.tau_pos", _loss_param("sapo", "tau_pos"), "-> actor.policy_loss_params.tau_pos (sapo)"),
    M(f"{_A}.tau_neg", _loss_param("sapo", "tau_neg"), "-> actor.policy_loss_params.tau_neg (sapo)"),
    M(f"{_A}.policy_loss.loss_mode", _loss_mode, "-> actor.policy_loss"),
    M(f"{_A}.policy_loss.clip_cov_ratio", _loss_param("clip_cov", "clip_cov_ratio"),
      "-> actor.policy_loss_params.clip_cov_ratio"),
    M(f"{_A}.policy_loss.clip_cov_lb", _loss_param("clip_cov", "cov_lb"), "-> actor.policy_loss_params.cov_lb"),
    M(f"{_A}.policy_loss.clip_cov_ub", _loss_param("clip_cov", "cov_ub"), "-> actor.policy_loss_params.cov_ub"),
    M(f"{_A}.policy_loss.kl_cov_ratio", _loss_param("kl_cov", "kl_cov_ratio"),
      "-> actor.policy_loss_params.kl_cov_ratio"),
    M(f"{_A}.policy_loss.ppo_kl_coef", _loss_param("kl_cov", "ppo_kl_coef"),
      "-> actor.policy_loss_params.ppo_kl_coef"),
    I(f"{_A}.policy_loss._target_", "Hydra's class marker"),
    M(f"{_A}.loss_agg_mode", to("actor.loss_agg_mode", conv=str)),
    R(f"{_A}.loss_scale_factor", "seq-mean-token-sum-norm divides by the response length limit here", (None,)),
    M(f"{_A}.entropy_coeff", to("actor.entropy_coeff", conv=float)),
    I(f"{_A}.calculate_entropy", "the entropy is always computed (actor/entropy)"),
    I(f"{_A}.entropy_from_logits_with_chunking", _MEMORY),
    I(f"{_A}.entropy_checkpointing", _MEMORY),
    R(f"{_A}.calculate_sum_pi_squared", "read by the optimal-token-baseline estimators, which are not "
      "implemented", (False,)),
    Dep(f"{_A}.sum_pi_squared_checkpointing", f"{_A}.calculate_sum_pi_squared", (False, None),
        "a memory setting of sum_pi_squared"),
    M(f"{_A}.use_kl_loss", to("actor.use_kl_loss", conv=_bool)),
    M(f"{_A}.kl_loss_coef", to("actor.kl_loss_coef", conv=float)),
    M(f"{_A}.kl_loss_type", _kl_name("actor.kl_loss_type"), "-> actor.kl_loss_type (verl's names are "
      "registered: kl, abs, mse, low_var_kl, k1..k3, +)"),
    M(f"{_A}.use_fused_kernels", to("actor.fused_loss_head", conv=_bool)),
    Via(f"{_A}.use_remove_padding", "actor_rollout_ref.model.use_remove_padding (its default)"),
    M(f"{_A}.use_prefix_grouper", to("actor.share_prompt_prefix", conv=_bool),
      "-> actor.share_prompt_prefix (each shared prefix once in the training passes: a prefix tree)"),
    I(f"{_A}.use_torch_compile", _MEMORY),
    R(f"{_A}.ulysses_sequence_parallel_size", "Ulysses sequence parallelism is not implemented here", (1,)),
    R(f"{_A}.freeze_vision_tower", "text-only policies here", (False,)),
    R(f"{_A}.router_replay.mode", "MoE router replay is not part of this dialect's mapping", ("disabled",)),
    Dep(f"{_A}.router_replay.**", f"{_A}.router_replay.mode", ("disabled", None), "a router-replay setting"),
    R(f"{_A}.load_weight", "the policy always starts from model.path's weights", (True,)),
    I(f"{_A}.rollout_n", "a copy of actor_rollout_ref.rollout.n"),
    I(f"{_A}.nccl_timeout", "see actor_rollout_ref.nccl_timeout"),
    *_optim("actor", _A),
    *_fsdp(f"{_A}.fsdp_config", "actor"),
    *_megatron(f"{_A}.megatron", "actor"),
    *_checkpoint_profiler(_A),
    I(f"{_A}._target_", "Hydra's class marker"),
]

_REF: list[Rule] = [
    M(f"{_R}.strategy", _strategy("ref"), "-> ref.engine"),
    M(f"{_R}.fsdp_config.param_offload", _offload("ref"), "-> ref.cpu_offload (true turns it on)"),
    I(f"{_R}.fsdp_config.**", "the reference shards like actor.fsdp here; its layout does not change its "
      "log-probs"),
    *_log_prob_passes(_R),
    *_megatron(f"{_R}.megatron", "ref"),
    R(f"{_R}.ulysses_sequence_parallel_size", "Ulysses sequence parallelism is not implemented here", (1,)),
    I(f"{_R}.use_torch_compile", _MEMORY),
    I(f"{_R}.entropy_from_logits_with_chunking", _MEMORY),
    I(f"{_R}.entropy_checkpointing", _MEMORY),
    I(f"{_R}.rollout_n", "a copy of actor_rollout_ref.rollout.n"),
    R(f"{_R}.router_replay.mode", "MoE router replay is not part of this dialect's mapping", ("disabled",)),
    Dep(f"{_R}.router_replay.**", f"{_R}.router_replay.mode", ("disabled", None), "a router-replay setting"),
    R(f"{_R}.load_weight", "the reference always starts from model.path's weights", (True,)),
    *_checkpoint_profiler(_R),
    I(f"{_R}._target_", "Hydra's class marker"),
]

_SAME_SAMPLES = "how verl serves generation (in-process here); the samples do not depend on it"

_ROLLOUT: list[Rule] = [
    M(f"{_O}.name", _rollout_name, "-> rollout.engine (vllm, sglang, hf; torch is ours)"),
    I(f"{_O}.mode", _SAME_SAMPLES),
    M(f"{_O}.n", to("rollout.n", conv=int)),
    M(f"{_O}.temperature", to("rollout.temperature", conv=float)),
    M(f"{_O}.top_p", to("rollout.top_p", conv=float)),
    M(f"{_O}.top_k", _top_k("rollout.top_k"), "-> rollout.top_k (-1 -> 0: off)"),
    R(f"{_O}.do_sample", "training samples from the policy; greedy generation leaves nothing to train on", (True,)),
    M(f"{_O}.ignore_eos", to("rollout.ignore_eos", conv=_bool)),
    M(f"{_O}.dtype", to("rollout.dtype", conv=_dtype)),
    M(f"{_O}.gpu_memory_utilization", to("rollout.gpu_memory_utilization", conv=float)),
    M(f"{_O}.enforce_eager", to("rollout.enforce_eager", conv=_bool)),
    M(f"{_O}.tensor_model_parallel_size", to("rollout.tp", conv=int)),
    M(f"{_O}.max_num_seqs", to("rollout.max_batch_size", conv=int)),
    M(f"{_O}.max_model_len", to("rollout.max_model_len", conv=int)),
    M(f"{_O}.engine_kwargs.vllm", lambda v, ctx: {"rollout.engine_kwargs": dict(v)}
      if v and ctx.get(f"{_O}.name") == "vllm" else {}, "-> rollout.engine_kwargs (with name=vllm)"),
    M(f"{_O}.engine_kwargs.sglang", lambda v, ctx: {"rollout.engine_kwargs": dict(v)}
      if v and ctx.get(f"{_O}.name") == "sglang" else {}, "-> rollout.engine_kwargs (with name=sglang)"),
    M(f"{_O}.engine_kwargs.vllm.**", lambda v, ctx: {}, "merged through engine_kwargs.vllm"),
    M(f"{_O}.engine_kwargs.sglang.**", lambda v, ctx: {}, "merged through engine_kwargs.sglang"),
    R(f"{_O}.engine_kwargs.trtllm", "TensorRT-LLM is not an engine here", _noop_dict),
    M(f"{_O}.checkpoint_engine.update_weights_bucket_megabytes", to("rollout.sync_bucket_mb", conv=float),
      "-> rollout.sync_bucket_mb (the 3D-HybridEngine's bucket)"),
    R(f"{_O}.checkpoint_engine.backend", "weights move through the 3D-HybridEngine here", ("naive",)),
    R(f"{_O}.checkpoint_engine.engine_kwargs", "weights move through the 3D-HybridEngine here", _noop_dict),
    I(f"{_O}.checkpoint_engine._target_", "Hydra's class marker"),
    M(f"{_O}.prompt_length", to("data.max_prompt_length", conv=int), "-> data.max_prompt_length (verl's default "
      "is that key)"),
    M(f"{_O}.response_length", to("rollout.max_new_tokens", conv=int), "-> rollout.max_new_tokens (verl's "
      "default is data.max_response_length)"),
    I(f"{_O}.load_format", "weights reach the engine from the actor through the 3D-HybridEngine"),
    I(f"{_O}.free_cache_engine", "the engine's memory between generation phases: " + _MEMORY),
    I(f"{_O}.cudagraph_capture_sizes", _MEMORY),
    I(f"{_O}.max_num_batched_tokens", "vLLM's scheduling budget: " + _MEMORY),
    I(f"{_O}.enable_chunked_prefill", _MEMORY),
    I(f"{_O}.enable_prefix_caching", _MEMORY),
    I(f"{_O}.disable_log_stats", "the engine's own logging"),
    I(f"{_O}.scheduling_policy", "the order requests are served in; the samples do not depend on it"),
    I(f"{_O}.multi_stage_wake_up", _MEMORY),
    I(f"{_O}.layered_summon", _MEMORY),
    I(f"{_O}.skip_tokenizer_init", "the engine's start-up"),
    I(f"{_O}.calculate_log_probs", "the rollout's log-probs are always recorded (rollout/mismatch_*)"),
    R(f"{_O}.logprobs_mode", "the rollout's log-probs are those of the sampling distribution (processed)",
      ("processed_logprobs",)),
    I(f"{_O}.layer_name_map.**", "verl's own converters know the layouts"),
    R(f"{_O}.data_parallel_size", "generation replicas are the rollout's ranks / rollout.tp here", (1,)),
    R(f"{_O}.expert_parallel_size", "expert parallelism is not implemented here", (1,)),
    R(f"{_O}.pipeline_model_parallel_size", "generation runs without pipeline stages (TP_g x DP_g)", (1,)),
    R(f"{_O}.quantization", "quantized generation is not part of this dialect's mapping", (None,)),
    R(f"{_O}.quantization_config_file", "quantized generation is not part of this dialect's mapping", (None,)),
    R(f"{_O}.over_sample_rate", "over-sampling is not implemented", (0, 0.0)),
    R(f"{_O}.skip_rollout", "every step generates here", (False,)),
    Dep(f"{_O}.skip_dump_dir", f"{_O}.skip_rollout", (False, None), "where skipped rollouts are dumped"),
    R(f"{_O}.enable_rollout_routing_replay", "MoE router replay is not part of this dialect's mapping", (False,)),
    Dep(f"{_O}.mtp", "actor_rollout_ref.model.mtp.enable", (False, None), "the rollout's multi-token prediction"),
    R(f"{_O}.multi_turn.enable", "multi-turn rollouts are verl.agents here (docs/ARCHITECTURE.md)", (False,)),
    Dep(f"{_O}.multi_turn.**", f"{_O}.multi_turn.enable", (False, None), "a multi-turn setting"),
    R(f"{_O}.agent.default_agent_loop", "single-turn generation is the only loop of this dialect",
      ("single_turn_agent",)),
    R(f"{_O}.agent.agent_loop_config_path", "agent loops are verl.agents here", (None,)),
    R(f"{_O}.agent.custom_async_server.path", "generation servers are not pluggable", (None,)),
    I(f"{_O}.agent.**", "verl's agent-loop workers; single-turn generation needs none"),
    R(f"{_O}.trace.backend", "rollout tracing services are not integrated; trainer.trace_step writes a trace",
      (None,)),
    Dep(f"{_O}.trace.**", f"{_O}.trace.backend", (None,), "a rollout-tracing setting"),
    R(f"{_O}.prometheus.enable", "Prometheus export is not integrated", (False,)),
    Dep(f"{_O}.prometheus.**", f"{_O}.prometheus.enable", (False, None), "a Prometheus setting"),
    M(f"{_O}.val_kwargs.temperature", _val_temperature, "-> val.temperature (0 when do_sample is false)"),
    Via(f"{_O}.val_kwargs.do_sample", f"{_O}.val_kwargs.temperature"),
    M(f"{_O}.val_kwargs.n", to("val.n", conv=int)),
    M(f"{_O}.val_kwargs.top_p", to("val.top_p", conv=float)),
    M(f"{_O}.val_kwargs.top_k", _top_k("val.top_k"), "-> val.top_k (-1 -> 0: off)"),
    I(f"{_O}.val_kwargs._target_", "Hydra's class marker"),
    *_log_prob_passes(_O),
    *_checkpoint_profiler(_O),
    I(f"{_O}._target_", "Hydra's class marker"),
]

_MODEL: list[Rule] = [*_model("actor_rollout_ref.model", "actor"),
                      M("actor_rollout_ref.nccl_timeout", to("trainer.collective_timeout_s", conv=float)),
                      R("actor_rollout_ref.hybrid_engine", "the actor and its rollout always share weights through "
                        "the 3D-HybridEngine here", (True,))]

_C = "critic"
_CRITIC: list[Rule] = [
    R(f"{_C}.enable", "the estimator decides: gae trains a critic, the others do not",
      lambda v, ctx: _none(v) or _bool(v) == ctx.uses_critic),
    M(f"{_C}.strategy", _strategy("critic"), "-> critic.engine"),
    M(f"{_C}.ppo_mini_batch_size", to("critic.mini_batch_size", conv=int)),
    M(f"{_C}.ppo_micro_batch_size_per_gpu", _micro_per_gpu("critic"), "-> critic.micro_batch_size"),
    M(f"{_C}.ppo_micro_batch_size", _micro_global("critic"), "-> critic.micro_batch_size = value / (n_gpus x "
      "nnodes)"),
    M(f"{_C}.use_dynamic_bsz", _dynamic_bsz(_C, "critic"), "-> critic.max_tokens_per_micro_batch"),
    Via(f"{_C}.ppo_max_token_len_per_gpu", f"{_C}.use_dynamic_bsz"),
    I(f"{_C}.forward_micro_batch_size", "the value pass uses critic.micro_batch_size; " + _MEMORY),
    I(f"{_C}.forward_micro_batch_size_per_gpu", "the value pass uses critic.micro_batch_size; " + _MEMORY),
    I(f"{_C}.forward_max_token_len_per_gpu", "the value pass uses critic.max_tokens_per_micro_batch; " + _MEMORY),
    M(f"{_C}.ppo_epochs", to("critic.ppo_epochs", conv=int)),
    M(f"{_C}.cliprange_value", to("critic.cliprange_value", conv=float)),
    R(f"{_C}.loss_agg_mode", "the value loss is token-mean here",
      lambda v, ctx: str(v) == "token-mean" or not ctx.uses_critic),
    R(f"{_C}.shuffle", "mini-batches are taken in generation order here", (False,)),
    Dep(f"{_C}.data_loader_seed", f"{_C}.shuffle", (False, None), "the shuffle's seed"),
    I(f"{_C}.rollout_n", "a copy of actor_rollout_ref.rollout.n"),
    R(f"{_C}.ulysses_sequence_parallel_size", "Ulysses sequence parallelism is not implemented here", (1,)),
    R(f"{_C}.load_weight", "the critic always starts from the policy's weights", (True,)),
    I(f"{_C}.nccl_timeout", "see actor_rollout_ref.nccl_timeout"),
    *_optim("critic", _C),
    *_model(f"{_C}.model", "critic"),
    *_megatron(f"{_C}.megatron", "critic"),
    *_checkpoint_profiler(_C),
    I(f"{_C}._target_", "Hydra's class marker"),
]

_RM = "reward_model"
_OFF_RM = "read only with reward_model.enable=True"
_REWARD: list[Rule] = [
    M(f"{_RM}.enable", _reward_model_enable, "true -> reward.type=model, reward.model_path=reward_model.model.path "
      "(a sequence-classification or value-head model, on the torch engine)"),
    M(f"{_RM}.micro_batch_size_per_gpu", to("reward.micro_batch_size", conv=int)),
    M(f"{_RM}.micro_batch_size", lambda v, ctx: {} if _none(v) else
      {"reward.micro_batch_size": max(1, _int(v) // ctx.world)}, "-> reward.micro_batch_size = value / world"),
    M(f"{_RM}.model.fsdp_config.param_offload", _offload("reward"), "-> reward.cpu_offload (true turns it on)"),
    M(f"{_RM}.megatron.param_offload", _offload("reward"), "-> reward.cpu_offload (true turns it on)"),
    Via(f"{_RM}.model.path", f"{_RM}.enable"),
    I(f"{_RM}.model.input_tokenizer", "the reward model re-tokenizes the text with its own tokenizer here"),
    R(f"{_RM}.model.trust_remote_code", "code shipped with a model is not run here", (False,)),
    R(f"{_RM}.model.external_lib", "importing a library to register model classes is not supported", (None,)),
    R(f"{_RM}.model.override_config", "overriding a reward model's config is not supported", _noop_dict),
    I(f"{_RM}.model.**", "how verl shards / loads its reward model; it runs on the torch engine here"),
    R(f"{_RM}.max_length", "a reward model input longer than its max_position_embeddings is an error here "
      "(verl cuts it)", (None,)),
    I(f"{_RM}.strategy", "the reward model runs on the torch engine here"),
    I(f"{_RM}.megatron.**", "the reward model runs on the torch engine here; its layout does not change scores"),
    I(f"{_RM}.use_dynamic_bsz", "reward-model micro-batching: " + _MEMORY),
    I(f"{_RM}.forward_max_token_len_per_gpu", "reward-model micro-batching: " + _MEMORY),
    I(f"{_RM}.launch_reward_fn_async", "rule rewards run in the step's reward node; " + _MEMORY),
    I(f"{_RM}.num_workers", "rule rewards run in the step's reward node"),
    R(f"{_RM}.enable_resource_pool", "a separate pool of GPUs is reward.ranks here", (False,)),
    R(f"{_RM}.n_gpus_per_node", "a separate pool of GPUs is reward.ranks here",
      lambda v, ctx: not _bool(ctx.get(f"{_RM}.enable_resource_pool", False))),
    R(f"{_RM}.nnodes", "a separate pool of GPUs is reward.ranks here",
      lambda v, ctx: not _bool(ctx.get(f"{_RM}.enable_resource_pool", False))),
    I(f"{_RM}.nccl_timeout", "see actor_rollout_ref.nccl_timeout"),
    R(f"{_RM}.load_weight", "the reward model always loads its weights", (True,)),
    M(f"{_RM}.reward_manager", _reward_manager, "naive / batch: the function's signature decides; dapo: adds the "
      "overlong penalty"),
    M(f"{_RM}.reward_kwargs.overlong_buffer_cfg.len", _overlong, "-> reward.overlong_buffer (dapo)"),
    M(f"{_RM}.reward_kwargs.overlong_buffer_cfg.penalty_factor", _overlong_factor,
      "-> reward.overlong_penalty_factor (dapo)"),
    Via(f"{_RM}.reward_kwargs.overlong_buffer_cfg.enable", f"{_RM}.reward_kwargs.overlong_buffer_cfg.len"),
    I(f"{_RM}.reward_kwargs.overlong_buffer_cfg.log", "reward/overlong_penalty/mean is always logged"),
    M(f"{_RM}.reward_kwargs.max_resp_len", _max_resp_len, "must equal data.max_response_length"),
    R(f"{_RM}.reward_kwargs.**", "reward manager arguments other than the dapo overlong buffer are not "
      "supported", ()),
    R(f"{_RM}.reward_loop_source", "reward loops are not supported", ("register",)),
    I(f"{_RM}.use_reward_loop", "how verl schedules reward computation; rewards are scored in the step's reward "
      "node here, with the same results"),
    R(f"{_RM}.ulysses_sequence_parallel_size", "Ulysses sequence parallelism is not implemented here", (1,)),
    R(f"{_RM}.reward_loop_module_path", "reward loops are not supported", (None,)),
    R(f"{_RM}.reward_loop_class_name", "reward loops are not supported", (None,)),
    Dep(f"{_RM}.rollout.**", f"{_RM}.reward_loop_class_name", (None,), "a generative reward model's rollout setting"),
    R(f"{_RM}.sandbox_fusion.url", "sandboxed code execution is verl.agents' Python tool here", (None,)),
    Dep(f"{_RM}.sandbox_fusion.**", f"{_RM}.sandbox_fusion.url", (None,), "a sandbox setting"),
    *_checkpoint_profiler(_RM),
    I(f"{_RM}._target_", "Hydra's class marker"),
    M("custom_reward_function.path", lambda v, ctx: {"reward.name": "by_data_source"} if _none(v) else
      _custom_reward(v, ctx), "-> reward.name=<path>:<name> (loaded from the file); null: by_data_source, verl's "
      "rule per data source"),
    Via("custom_reward_function.name", "custom_reward_function.path"),
    R("custom_reward_function.reward_kwargs", "extra arguments to compute_score are not supported", _noop_dict),
    R("custom_reward_function.reward_kwargs.**", "extra arguments to compute_score are not supported", ()),
    M("reward_manager.name", _reward_manager, "as reward_model.reward_manager"),
    R("reward_manager.source", "reward managers are built in here", ("register",)),
    R("reward_manager.module.path", "custom reward managers are not supported; a custom_reward_function is",
      (None,)),
    Dep("reward_manager.module.name", "reward_manager.module.path", (None,), "the custom reward manager's name"),
    I("reward_manager._target_", "Hydra's class marker"),
]

_RC = "algorithm.rollout_correction"
_ALGORITHM: list[Rule] = [
    M("algorithm.adv_estimator", _estimator, "-> algorithm.adv_estimator (rloo_vectorized -> rloo, "
      "grpo_vectorized -> grpo)"),
    M("algorithm.gamma", to("algorithm.gamma", conv=float)),
    M("algorithm.lam", to("algorithm.lam", conv=float)),
    M("algorithm.norm_adv_by_std_in_grpo", to("algorithm.norm_adv_by_std_in_grpo", conv=_bool)),
    M("algorithm.use_kl_in_reward", to("algorithm.use_kl_in_reward", conv=_bool)),
    M("algorithm.kl_penalty", _kl_name("algorithm.kl_penalty"), "-> algorithm.kl_penalty"),
    M("algorithm.kl_ctrl.type", to("algorithm.kl_ctrl.type", conv=str)),
    M("algorithm.kl_ctrl.kl_coef", to("algorithm.kl_ctrl.kl_coef", conv=float)),
    M("algorithm.kl_ctrl.target_kl", to("algorithm.kl_ctrl.target_kl", conv=float)),
    M("algorithm.kl_ctrl.horizon", to("algorithm.kl_ctrl.horizon", conv=int)),
    I("algorithm.kl_ctrl._target_", "Hydra's class marker"),
    R("algorithm.use_pf_ppo", "preference-feedback PPO reweighting is not implemented", (False,)),
    Dep("algorithm.pf_ppo.**", "algorithm.use_pf_ppo", (False, None), "a pf-PPO setting"),
    M(f"{_RC}.rollout_is", _is_level, f"-> {_RC}.is_level (token / sequence)"),
    M(f"{_RC}.rollout_is_threshold", to(f"{_RC}.is_cap", conv=float)),
    R(f"{_RC}.rollout_is_batch_normalize", "IS weights are not renormalised over the batch here", (False,)),
    M(f"{_RC}.rollout_rs", _rs_level, f"-> {_RC}.rejection_level with rejection_lower / upper from "
      "rollout_rs_threshold ('lower_upper', or an upper bound whose inverse is the lower one)"),
    Via(f"{_RC}.rollout_rs_threshold", f"{_RC}.rollout_rs"),
    M(f"{_RC}.bypass_mode", to(f"{_RC}.bypass", conv=_bool)),
    R(f"{_RC}.loss_type", "the bypass mode's loss is the configured policy loss (ppo_clip)", ("ppo_clip",)),
    I(f"{_RC}._target_", "Hydra's class marker"),
    I("algorithm._target_", "Hydra's class marker"),
]

_TRAINER: list[Rule] = [
    M("trainer.total_epochs", _total_epochs, "-> trainer.total_epochs (the run's length in passes over the "
      "data, unless total_training_steps is set)"),
    M("trainer.total_training_steps", _total_steps, "-> trainer.total_steps"),
    M("trainer.n_gpus_per_node", lambda v, ctx: {}, "n_gpus_per_node x nnodes must be the torchrun world; a "
      "single `python -m verl.trainer.main_ppo` starts that many processes on this node itself"),
    M("trainer.nnodes", lambda v, ctx: {}, "see trainer.n_gpus_per_node"),
    M("trainer.save_freq", _save_freq, "-> trainer.save_every, save_final (-1: no checkpoints)"),
    M("trainer.test_freq", to("trainer.test_freq", conv=lambda v: max(0, int(v))), "-> trainer.test_freq (-1 -> 0)"),
    M("trainer.val_before_train", to("trainer.val_before_train", conv=_bool)),
    M("trainer.val_only", to("trainer.val_only", conv=_bool)),
    M("trainer.log_val_generations", to("val.log_generations", conv=int)),
    M("trainer.critic_warmup", to("critic.warmup_steps", conv=int)),
    M("trainer.default_local_dir", to("trainer.output_dir", conv=lambda v: os.path.expanduser(str(v)))),
    M("trainer.resume_mode", _resume, "-> trainer.resume (auto / disable -> None / resume_path)"),
    Via("trainer.resume_from_path", "trainer.resume_mode"),
    M("trainer.max_actor_ckpt_to_keep", lambda v, ctx: {"trainer.keep_checkpoints": 0 if _none(v) else _int(v)},
      "-> trainer.keep_checkpoints (null: all)"),
    R("trainer.max_critic_ckpt_to_keep", "one checkpoint holds the actor and the critic here; keep "
      "max_actor_ckpt_to_keep", lambda v, ctx: _none(v) or v == ctx.get("trainer.max_actor_ckpt_to_keep")),
    M("trainer.logger", _logger, "console -> trainer.progress_bar; metrics always go to metrics.jsonl and "
      "TensorBoard (wandb, mlflow, ... are not sinks here: noted)"),
    Via("trainer.project_name", "trainer.default_local_dir (its default names the folder)"),
    Via("trainer.experiment_name", "trainer.default_local_dir (its default names the folder)"),
    M("trainer.device", _device, "-> trainer.device (cuda -> auto)"),
    R("trainer.default_hdfs_dir", "copying checkpoints to HDFS is not supported", (None,)),
    R("trainer.del_local_ckpt_after_load", "checkpoints are kept after a resume", (False,)),
    R("trainer.rollout_data_dir", "dumping every rollout is not supported; trainer.trace_step records a step",
      (None,)),
    R("trainer.validation_data_dir", "validation generations go to <output_dir>/val_generations.jsonl "
      "(trainer.log_val_generations)", (None,)),
    I("trainer.balance_batch", "reorders samples over data-parallel ranks for equal token counts: " + _MEMORY),
    I("trainer.use_legacy_worker_impl", "which of verl's two worker implementations runs"),
    I("trainer.esi_redundant_time", "checkpoint timing before a cloud instance expires"),
    I("trainer.ray_wait_register_center_timeout", _RAY),
    R("trainer.npu_profile.**", "Ascend NPUs are not supported", ()),
    I("trainer._target_", "Hydra's class marker"),
]

_MISC: list[Rule] = [
    I("ray_kwargs.**", _RAY),
    I("ray_init.**", _RAY),
    R("transfer_queue.enable", "verl's TransferQueue (a Ray data plane) is not used: batches move through the "
      "dataflow", (False,)),
    Dep("transfer_queue.**", "transfer_queue.enable", (False, None), "a TransferQueue setting"),
    R("global_profiler.tool", "verl's profiler integration is not available; trainer.trace_step writes a Chrome "
      "trace of one step", (None,)),
    R("global_profiler.steps", "verl's profiler integration is not available", (None,)),
    Dep("global_profiler.**", "global_profiler.tool", (None,), "a profiler setting"),
    I("hydra.**", "Hydra's own settings (output folders, search paths)"),
    I("**._target_", "Hydra's class marker: the typed config here is fixed"),
]

TABLE: list[Rule] = [*_DATA, *_ACTOR, *_REF, *_ROLLOUT, *_MODEL, *_CRITIC, *_REWARD, *_ALGORITHM, *_TRAINER,
                     *_MISC]
"""The one translation table (first matching pattern wins)."""


# ---------------------------------------------------------------------------------------------- verl's defaults

VERL_DEFAULTS: dict[str, Any] = {
    "data.train_files": "~/data/rlhf/gsm8k/train.parquet", "data.val_files": "~/data/rlhf/gsm8k/test.parquet",
    "data.prompt_key": "prompt", "data.reward_fn_key": "data_source", "data.max_prompt_length": 512,
    "data.max_response_length": 512, "data.train_batch_size": 1024, "data.val_batch_size": None,
    "data.train_max_samples": -1, "data.val_max_samples": -1, "data.shuffle": True, "data.seed": None,
    "data.filter_overlong_prompts": False, "data.truncation": "error",
    "actor_rollout_ref.model.path": "~/models/deepseek-llm-7b-chat", "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.model.use_fused_kernels": False, "critic.model.use_remove_padding": False,
    f"{_O}.enforce_eager": False,
    f"{_A}.strategy": "fsdp", f"{_A}.ppo_mini_batch_size": 256, f"{_A}.ppo_micro_batch_size": None,
    f"{_A}.ppo_micro_batch_size_per_gpu": None, f"{_A}.use_dynamic_bsz": False,
    f"{_A}.ppo_max_token_len_per_gpu": 16384, f"{_A}.ppo_epochs": 1, f"{_A}.clip_ratio": 0.2,
    f"{_A}.clip_ratio_low": 0.2, f"{_A}.clip_ratio_high": 0.2, f"{_A}.clip_ratio_c": 3.0, f"{_A}.tau_pos": 1.0,
    f"{_A}.tau_neg": 1.05, f"{_A}.policy_loss.loss_mode": "vanilla", f"{_A}.loss_agg_mode": "token-mean",
    f"{_A}.entropy_coeff": 0, f"{_A}.use_kl_loss": False, f"{_A}.kl_loss_coef": 0.001,
    f"{_A}.kl_loss_type": "low_var_kl", f"{_A}.use_prefix_grouper": False, f"{_A}.grad_clip": 1.0,
    f"{_A}.optim.lr": 1e-6, f"{_A}.optim.weight_decay": 0.01, f"{_A}.optim.betas": [0.9, 0.999],
    f"{_A}.optim.clip_grad": 1.0, f"{_A}.optim.lr_warmup_steps": -1, f"{_A}.optim.lr_warmup_steps_ratio": 0.0,
    f"{_A}.optim.lr_scheduler_type": "constant", f"{_A}.optim.min_lr_ratio": 0.0,
    f"{_A}.fsdp_config.param_offload": False, f"{_A}.fsdp_config.optimizer_offload": False,
    f"{_A}.fsdp_config.fsdp_size": -1, f"{_A}.fsdp_config.reshard_after_forward": True,
    f"{_A}.fsdp_config.dtype": "bfloat16", f"{_A}.fsdp_config.model_dtype": "fp32",
    f"{_R}.strategy": f"${{{_A}.strategy}}", f"{_R}.fsdp_config.param_offload": False,
    f"{_O}.name": "???", f"{_O}.n": 1, f"{_O}.temperature": 1.0, f"{_O}.top_p": 1, f"{_O}.top_k": -1,
    f"{_O}.do_sample": True, f"{_O}.ignore_eos": False, f"{_O}.dtype": "bfloat16",
    f"{_O}.gpu_memory_utilization": 0.5, f"{_O}.tensor_model_parallel_size": 2, f"{_O}.max_num_seqs": 256,
    f"{_O}.max_model_len": None, f"{_O}.checkpoint_engine.update_weights_bucket_megabytes": 2048,
    f"{_O}.val_kwargs.do_sample": False, f"{_O}.val_kwargs.n": 1, f"{_O}.val_kwargs.temperature": 0,
    f"{_O}.val_kwargs.top_p": 1.0, f"{_O}.val_kwargs.top_k": -1, "actor_rollout_ref.nccl_timeout": 600,
    "critic.strategy": "fsdp", "critic.model.path": "~/models/deepseek-llm-7b-chat",
    "critic.ppo_mini_batch_size": f"${{oc.select:{_A}.ppo_mini_batch_size,256}}",
    "critic.ppo_micro_batch_size": None, "critic.ppo_micro_batch_size_per_gpu": None,
    "critic.use_dynamic_bsz": f"${{oc.select:{_A}.use_dynamic_bsz,false}}", "critic.ppo_max_token_len_per_gpu": 32768,
    "critic.ppo_epochs": f"${{oc.select:{_A}.ppo_epochs,1}}", "critic.cliprange_value": 0.5,
    "critic.loss_agg_mode": f"${{oc.select:{_A}.loss_agg_mode,token-mean}}", "critic.grad_clip": 1.0,
    "critic.optim.lr": 1e-5, "critic.optim.weight_decay": 0.01, "critic.optim.betas": [0.9, 0.999],
    "critic.optim.clip_grad": 1.0, "critic.optim.lr_warmup_steps": -1, "critic.optim.lr_warmup_steps_ratio": 0.0,
    "critic.optim.lr_scheduler_type": "constant", "critic.optim.min_lr_ratio": 0.0,
    "critic.model.fsdp_config.param_offload": False, "critic.model.fsdp_config.optimizer_offload": False,
    "critic.model.fsdp_config.fsdp_size": -1, "critic.model.fsdp_config.reshard_after_forward": True,
    "critic.model.fsdp_config.dtype": "bfloat16",
    "reward_model.enable": False, "reward_model.reward_manager": "naive", "reward_model.micro_batch_size": None,
    "reward_model.micro_batch_size_per_gpu": None, "custom_reward_function.path": None,
    "custom_reward_function.name": "compute_score",
    "algorithm.adv_estimator": "gae", "algorithm.gamma": 1.0, "algorithm.lam": 1.0,
    "algorithm.norm_adv_by_std_in_grpo": True, "algorithm.use_kl_in_reward": False, "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.kl_coef": 0.001, "algorithm.kl_ctrl.target_kl": 0.1,
    "algorithm.kl_ctrl.horizon": 10000, f"{_RC}.rollout_is": None, f"{_RC}.rollout_is_threshold": 2.0,
    f"{_RC}.rollout_rs": None, f"{_RC}.rollout_rs_threshold": None, f"{_RC}.bypass_mode": False,
    "trainer.total_epochs": 30, "trainer.total_training_steps": None, "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k", "trainer.logger": ["console", "wandb"], "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8, "trainer.save_freq": -1, "trainer.resume_mode": "auto",
    "trainer.resume_from_path": None, "trainer.test_freq": -1, "trainer.critic_warmup": 0,
    "trainer.default_local_dir": "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
    "trainer.max_actor_ckpt_to_keep": None, "trainer.max_critic_ckpt_to_keep": None,
    "trainer.val_before_train": True, "trainer.val_only": False, "trainer.log_val_generations": 0,
    "trainer.device": "cuda",
}
"""verl's defaults (its ppo_trainer.yaml) of every key whose translation differs from our own default or that
another key's rule reads; a verl command line starts from these."""

VERL_MEGATRON_DEFAULTS: dict[str, Any] = {
    f"{_A}.strategy": "megatron", f"{_R}.strategy": "megatron", "critic.strategy": "megatron",
    f"{_A}.megatron.tensor_model_parallel_size": 1, f"{_A}.megatron.pipeline_model_parallel_size": 1,
    f"{_A}.megatron.sequence_parallel": True, f"{_A}.megatron.use_distributed_optimizer": True,
    f"{_A}.megatron.dtype": "bfloat16", f"{_A}.optim.optimizer": "adam", f"{_A}.megatron.use_remove_padding": True,
    "actor_rollout_ref.model.use_remove_padding": False, "critic.megatron.use_remove_padding": True,
    f"{_R}.megatron.tensor_model_parallel_size": f"${{oc.select:{_A}.megatron.tensor_model_parallel_size,1}}",
    f"{_R}.megatron.pipeline_model_parallel_size": f"${{oc.select:{_A}.megatron.pipeline_model_parallel_size,1}}",
    f"{_R}.megatron.sequence_parallel": True, f"{_R}.megatron.use_distributed_optimizer": True,
    f"{_R}.megatron.dtype": "bfloat16",
}
"""What verl's ppo_megatron_trainer.yaml (--config-name=ppo_megatron_trainer) changes on top of VERL_DEFAULTS,
for the keys above."""


# ---------------------------------------------------------------------------------------------- translation

@dataclass
class Entry:
    """What became of one verl key."""

    key: str
    value: Any
    kind: str
    """map, ignore or refuse (a refusal that stops the job)."""
    detail: str
    """map: the keys it set (`ours=value`, ...); ignore / refuse: the reason."""
    given: bool = True
    """The user wrote it (else it is verl's default)."""


@dataclass
class Translation:
    """The outcome of `translate`: our dotted keys and values, and what became of every verl key."""

    native: dict[str, Any] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    world: int = 1
    """trainer.n_gpus_per_node x trainer.nnodes: the processes the job expects."""
    nnodes: int = 1

    @property
    def refused(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "refuse"]

    def check(self) -> None:
        """Raises VerlConfigError listing every refused key (before anything runs)."""
        if self.refused:
            lines = [f"  {e.key}={e.value!r}: {e.detail}" for e in self.refused]
            raise VerlConfigError(f"{len(lines)} verl key(s) cannot be expressed here:\n" + "\n".join(lines) +
                                  "\n(`verl compat` prints the whole translation)")


def rule_for(key: str) -> Rule | None:
    """The table's rule for the verl key `key` (None: not a verl key)."""
    for rule in TABLE:
        if rule.matches(key):
            return rule
    return None


_VERL_TOPS = ("actor_rollout_ref", "reward_model", "custom_reward_function", "ray_kwargs", "ray_init",
              "global_profiler", "reward_manager", "transfer_queue", "hydra", "defaults")


def is_verl_key(key: str) -> bool:
    """`key` is upstream verl's and not also ours (its presence puts a command line in the verl dialect)."""
    key = key.lstrip("+~")
    if key.split(".")[0] in _VERL_TOPS:
        return True
    return rule_for(key) is not None and not _is_native(key)


def _is_native(key: str) -> bool:
    from verl.config.base import _check_path
    from verl.config.ppo import PPOConfig
    try:
        _check_path(PPOConfig, key.split("."))
    except VerlConfigError:
        return False
    return True


def _set(tree: dict, key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = copy.deepcopy(value)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def translate(overrides: list[str] = (), yaml_data: dict | None = None, *, megatron: bool = False,
              defaults: bool = True) -> Translation:
    """Our config for a verl command line: verl's defaults (`defaults`; the megatron trainer's with `megatron`),
    then `yaml_data` (a verl YAML's mapping), then `overrides` (`key=value`, Hydra's `+key` accepted); keys of
    our own dialect among the overrides pass through after the verl ones. Unknown keys raise VerlConfigError
    naming the nearest key of each dialect; refused values are in `.refused` (`.check()` raises them)."""
    from verl.config.base import _parse_override
    tree: dict = {}
    if defaults:
        for key, value in {**VERL_DEFAULTS, **(VERL_MEGATRON_DEFAULTS if megatron else {})}.items():
            if not (megatron and ".fsdp_config." in key):  # the megatron trainer has no FSDP settings
                _set(tree, key, value)
    given: list[str] = []
    for key, value in _flatten(_strip_hydra(yaml_data or {})).items():
        _set(tree, key, value)
        given.append(key)
    native: list[tuple[str, Any]] = []
    for item in overrides:
        path, value = _parse_override(item)
        key = ".".join(path).lstrip("+")
        if rule_for(key) is None and _is_native(key):
            native.append((key, value))
            continue
        _set(tree, key, value)  # a parent's value replaces its subtree, as in Hydra
        given.append(key)
    flat = _resolve(_flatten(tree))
    out = _apply(flat, {k for k in flat if any(k == g or k.startswith(g + ".") for g in given)})
    for key, value in native:
        out.native[key] = value
        out.entries.append(Entry(key, value, "native", "a key of this dialect"))
    return out


def _strip_hydra(data: dict) -> dict:
    """A verl YAML's own keys (Hydra's `defaults` list and `hydra` node are composition directives)."""
    return {k: v for k, v in data.items() if k not in ("defaults", "hydra")}


def _apply(flat: dict[str, Any], given: set[str]) -> Translation:
    ctx = _Ctx(flat)
    out = Translation(world=ctx.world, nnodes=max(1, _int(ctx.get("trainer.nnodes", 1))))
    unknown = [k for k in flat if rule_for(k) is None]
    if unknown:
        raise VerlConfigError("; ".join(_unknown(k) for k in unknown))
    # verl's defaults first, then what the user wrote, so that a written key wins over a defaulted one
    for key in sorted(flat, key=lambda k: k in given):
        entry = _apply_rule(rule_for(key), key, flat[key], ctx)
        entry.given = key in given
        out.entries.append(entry)
        if entry.kind == "map":
            out.native.update(entry.native)
    out.notes = list(dict.fromkeys(ctx.notes))
    return out


def _apply_rule(rule: Rule, key: str, value: Any, ctx: _Ctx) -> Entry:
    if rule.kind == "ignore":
        return Entry(key, value, "ignore", rule.why)
    if rule.kind == "refuse":
        if rule.ok is not None and rule.ok(value, ctx):
            return Entry(key, value, "ignore", f"no effect at this value ({rule.why} otherwise)")
        return _unused(key, value, rule.why, ctx)
    try:
        native = rule.convert(value, ctx)
    except _Ignored as e:
        return Entry(key, value, "ignore", str(e))
    except _Refused as e:
        return _unused(key, value, str(e), ctx)
    entry = Entry(key, value, "map", ", ".join(f"{k}={v!r}" for k, v in native.items()) or
                  f"(nothing to set: {rule.why.removeprefix('-> ')})")
    entry.native = native
    return entry


def _unused(key: str, value: Any, why: str, ctx: _Ctx) -> Entry:
    """A refusal, unless the key's role does not run in this job (a critic without gae, a reference without a KL
    term, a reward model that is off): then the value has no effect."""
    idle = ((key.startswith("critic.") and not ctx.uses_critic) or
            (key.startswith("actor_rollout_ref.ref.") and not ctx.uses_ref) or
            (key.startswith("reward_model.") and not key.startswith("reward_model.reward") and
             not ctx.uses_reward_model))
    if idle:
        return Entry(key, value, "ignore", f"its role does not run in this job ({why} otherwise)")
    return Entry(key, value, "refuse", why)


def _unknown(key: str) -> str:
    from verl.config.base import describe
    from verl.config.ppo import PPOConfig
    verl_keys = sorted({*VERL_DEFAULTS, *(r.pattern for r in TABLE if "*" not in r.pattern)})
    ours = [line.split(" ")[0].rstrip(":") for line in describe(PPOConfig)]
    near_v = difflib.get_close_matches(key, verl_keys, n=1, cutoff=0.6)
    near_o = difflib.get_close_matches(key, ours, n=1, cutoff=0.6)
    return (f"unknown config key '{key}': not a key of upstream verl (nearest: {near_v[0] if near_v else 'none'}) "
            f"nor of this verl (nearest: {near_o[0] if near_o else 'none'}); `verl compat --keys` lists verl's, "
            f"`verl train --help` ours")


# ---------------------------------------------------------------------------------------------- interpolation

def _resolve(flat: dict[str, Any]) -> dict[str, Any]:
    """Hydra / OmegaConf interpolations in the values: ${a.b}, ${.sibling}, ${oc.select:a.b,default},
    ${oc.env:VAR,default}; others are left as text (and refused by the key's rule, if it reads them)."""
    out = dict(flat)
    for key in flat:
        out[key] = _value(out, key, out[key], depth=0)
    return out


def _value(flat: dict, key: str, value: Any, depth: int) -> Any:
    if not isinstance(value, str) or "${" not in value or depth > 10:
        return value
    import re
    whole = re.fullmatch(r"\$\{([^{}]*)\}", value.strip())
    if whole:
        return _lookup(flat, key, whole.group(1), depth)
    return re.sub(r"\$\{([^{}]*)\}", lambda m: str(_lookup(flat, key, m.group(1), depth)), value)


def _lookup(flat: dict, key: str, expr: str, depth: int) -> Any:
    import yaml
    if expr.startswith("oc.env:"):
        name, _, default = expr[len("oc.env:"):].partition(",")
        return os.environ.get(name.strip(), yaml.safe_load(default) if default else None)
    select = expr.startswith("oc.select:")
    path, _, default = (expr[len("oc.select:"):] if select else expr).partition(",")
    path = path.strip()
    if path.startswith("."):  # relative to the key's own node
        path = key.rsplit(".", 1)[0] + path
    if path in flat:
        return _value(flat, path, flat[path], depth + 1)
    sub = {k[len(path) + 1:]: _value(flat, k, v, depth + 1) for k, v in flat.items() if k.startswith(path + ".")}
    if sub:
        tree: dict = {}
        for k, v in sub.items():
            _set(tree, k, v)
        return tree
    if select:
        return yaml.safe_load(default) if default.strip() else None
    return "${" + expr + "}"


# ---------------------------------------------------------------------------------------------- command lines

VERL_CONFIG_NAMES = ("ppo_trainer", "ppo_megatron_trainer")
"""Hydra config names of upstream verl's trainer: selecting one starts from its defaults."""


def split_hydra(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Hydra's `--config-path X` / `--config-name=Y` (and -cp / -cn) out of `argv`: ({"path", "name"}, rest)."""
    flags, rest, i = {}, [], 0
    names = {"--config-path": "path", "-cp": "path", "--config-name": "name", "-cn": "name"}
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag in names:
            if not eq:
                if i + 1 >= len(argv):
                    raise VerlConfigError(f"{flag} needs a value")
                value, i = argv[i + 1], i + 1
            flags[names[flag]] = value
        else:
            rest.append(arg)
        i += 1
    return flags, rest


def load_job(argv: list[str], default_yaml) -> tuple[Any, Translation | None]:
    """(PPOConfig, Translation or None) of a command line: `[CONFIG.yaml] key=value ...` in our dialect, or in
    verl's (any verl key, a verl YAML, or --config-name); refused verl values raise before anything runs."""
    from pathlib import Path

    from verl.config.base import apply_overrides, from_dict, load_yaml
    from verl.config.ppo import PPOConfig
    hydra, rest = split_hydra(argv)
    yaml_path = Path(rest[0]) if rest and "=" not in rest[0] else None
    overrides = rest[1:] if yaml_path is not None else rest
    megatron = False
    if "name" in hydra:
        name = hydra["name"].removesuffix(".yaml")
        candidate = Path(hydra.get("path", ".")).expanduser() / f"{name}.yaml"
        if candidate.is_file():
            yaml_path = candidate
        elif name in VERL_CONFIG_NAMES:
            megatron = name == "ppo_megatron_trainer"
        else:
            raise VerlConfigError(f"--config-name={hydra['name']}: no file {str(candidate)!r}, and not one of "
                                  f"verl's trainer configs {VERL_CONFIG_NAMES}")
    data = load_yaml(yaml_path) if yaml_path is not None else None
    verl_yaml = data is not None and (any(is_verl_key(k) for k in _flatten(data)) or "defaults" in data)
    if not ("name" in hydra or verl_yaml or any(is_verl_key(o.partition("=")[0]) for o in overrides)):
        data = data if data is not None else load_yaml(default_yaml)
        return from_dict(PPOConfig, apply_overrides(PPOConfig, data, overrides)), None
    if verl_yaml:
        megatron = megatron or "ppo_megatron_trainer" in str(data.get("defaults", ""))
        t = translate(overrides, data, megatron=megatron)
        base: dict = {}
    else:  # our YAML (or none: verl's defaults) with verl keys among the overrides
        t = translate(overrides, None, megatron=megatron, defaults=data is None)
        base = data or {}
    t.check()
    tree = copy.deepcopy(base)
    for key, value in t.native.items():
        _set(tree, key, value)
    return from_dict(PPOConfig, tree), t
