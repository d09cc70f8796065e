"""verl.models: megatron-core GPT models (Llama / Qwen2 / Mistral) built from, loaded from and exported to
Hugging Face checkpoints, with TP / SP / PP, on CPU (gloo, via `megatron_patches`) and GPU.

Build and load (every call below is collective over the model's process groups unless noted)::

    from transformers import AutoConfig
    from verl.distributed import init_process_groups
    from verl.models import BuildOptions, build_gpt, load_hf_checkpoint, export_hf_checkpoint

    pg = init_process_groups(tp=2, pp=2, sequence_parallel=True)   # once per process, after dist init;
                                                                   # applies megatron_patches, seeds megatron RNG
    model = build_gpt(AutoConfig.from_pretrained(path), pg,
                      BuildOptions(params_dtype="float32", value_head=False))  # value_head=True: critic/reward
    load_hf_checkpoint(model, path)        # safetensors dir, single or sharded; each rank reads only its slices
    export_hf_checkpoint(model, out_dir, tokenizer=tok)   # transformers.from_pretrained(out_dir) loads it
                                                          # (value-head models export as *ForTokenClassification)

`model` is a `MegatronGPT`: `.module` (the GPTModel stage, DDP-wrapped after `build_optimizer`), `.gpt` (the
bare GPTModel), `.arch` (ArchSpec parsed from the HF config), `.layout` (vocab padding, KV split), `.pg`.

Forward (padded batches: input_ids [b, s], attention_mask [b, s] with 1 = token, left or right padding)::

    from verl.models import compute_log_probs, compute_values, compute_logits, forward_backward, make_micro_batches
    out = compute_log_probs(model, ids, mask, temperature=1.0, micro_batch_size=4)
    # out['log_probs'][:, t] = log p(ids[:, t+1] | ids[:, :t+1]); out['entropy']; out['token_mask']  (all [b, s],
    # float32, returned on every rank; pipeline stages get them broadcast from the last stage)
    values = compute_values(critic, ids, mask)                    # [b, s]
    metrics = forward_backward(model, make_micro_batches(ids, mask, 4, advantages=adv), my_loss_fn)

A loss is `loss_fn(output, micro_batch) -> (loss, metrics)`, where output is this TP rank's vocab-parallel logits
`[b, s, V_pad/tp]` (use `verl.ops.vocab_parallel_logprob_entropy(masked_vocab_logits(output, model),
mb['labels'], T, model.pg.tp)`) or the values `[b, s]`
of a value-head model. Micro-batch dicts carry input_ids, attention_mask, labels (next token or -100),
position_ids, mask_4d and any extra tensors passed to `make_micro_batches`. Ready-made: `causal_lm_loss(model)`,
`value_mse_loss()`. Megatron averages the returned loss over micro-batches and DP replicas.

Optimizer (megatron-core's, incl. the distributed optimizer; grad clipping; LR schedule)::

    from verl.config import OptimConfig           # the one optimizer config (the trainer's actor.optim)
    from verl.models.optimizer import build_optimizer, train_step, accumulate_grads, apply_update
    opt = build_optimizer(model, OptimConfig(lr=1e-6, grad_clip=1.0, warmup_steps=10, lr_decay_style="cosine"),
                          total_steps=1000, use_distributed_optimizer=True)
    stats = train_step(model, opt, micro_batches, loss_fn)   # {'loss'..., 'grad_norm', 'lr', 'update_applied'}
    save_training_state(model, opt, ckpt_dir); load_training_state(model, opt, ckpt_dir)   # same layout

Shard descriptions (for the 3D-HybridEngine; pure metadata)::

    for spec in model.shard_specs():          # one ShardSpec per local parameter (verl.models.layout)
        spec.name, spec.local_name, spec.hf_names, spec.global_shape, spec.dim, spec.parts, spec.kind
        spec.local_segments(model.pg.tp_rank) # [(Segment(hf_name, start, length), offset_in_local_tensor)]
    tensor = dict(model.gpt.named_parameters())[spec.local_name]

Kinds: qkv-fused (per query group [q heads; k; v], TP rank r holds rows [r*R/tp, (r+1)*R/tp) — a group may be
cut when tp > kv heads), gate-up-fused (per TP rank [gate_r; up_r]), column, row (partition dim 1), vocab
(padded with zero rows to a multiple of tp), replicated (norms), value-head. `gather_hf_state_dict(model,
tensors)` maps any per-parameter tensors (weights, grads) back to full HF-named tensors.
"""

from verl.models.checkpoint import export_hf_checkpoint, gather_hf_state_dict, load_hf_checkpoint
from verl.models.config import ArchSpec, ParallelLayout, arch_from_hf, parallel_layout
from verl.models.forward import (IGNORE_INDEX, LossFn, causal_lm_loss, compute_log_probs, compute_logits,
                                 compute_values, forward_backward, make_micro_batches, value_mse_loss)
from verl.models.gpt import BuildOptions, MegatronGPT, build_gpt
from verl.models.layout import KINDS, Segment, ShardSpec
from verl.models.vocab_parallel import masked_vocab_logits

__all__ = [
    "ArchSpec", "BuildOptions", "IGNORE_INDEX", "KINDS", "LossFn", "MegatronGPT", "ParallelLayout", "Segment",
    "ShardSpec", "arch_from_hf", "build_gpt", "causal_lm_loss", "compute_log_probs", "compute_logits",
    "compute_values", "export_hf_checkpoint", "forward_backward", "gather_hf_state_dict", "load_hf_checkpoint",
    "make_micro_batches", "masked_vocab_logits", "parallel_layout", "value_mse_loss",
]
