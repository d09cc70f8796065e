"""verl.models: megatron-core GPT models (Llama / Qwen2 / Mistral) from and to Hugging Face checkpoints.

API (every call collective over the model's process groups unless noted):

    from verl.distributed import init_process_groups
    from verl.models import BuildOptions, build_gpt, load_hf_checkpoint, export_hf_checkpoint

    pg = init_process_groups(tp=2, pp=2, sequence_parallel=True)     # once, after torch.distributed init
    model = build_gpt(AutoConfig.from_pretrained(path), pg, BuildOptions(params_dtype="bfloat16"))
    load_hf_checkpoint(model, path)            # each rank reads only its slices (safetensors get_slice)
    out = compute_log_probs(model, input_ids, attention_mask, temperature=1.0, micro_batch_size=4)
    export_hf_checkpoint(model, out_dir, tokenizer=tok)   # a directory transformers.from_pretrained loads
"""

from verl.models.checkpoint import export_hf_checkpoint, gather_hf_state_dict, load_hf_checkpoint
from verl.models.config import ArchSpec, ParallelLayout, arch_from_hf, parallel_layout
from verl.models.forward import (IGNORE_INDEX, LossFn, causal_lm_loss, compute_log_probs, compute_logits,
                                 compute_values, forward_backward, make_micro_batches, value_mse_loss)
from verl.models.gpt import BuildOptions, MegatronGPT, build_gpt
from verl.models.layout import KINDS, Segment, ShardSpec
from verl.models.vocab_parallel import vocab_parallel_logprob_entropy, vocab_parallel_logprob_entropy_ref

__all__ = [
    "ArchSpec", "BuildOptions", "IGNORE_INDEX", "KINDS", "LossFn", "MegatronGPT", "ParallelLayout", "Segment",
    "ShardSpec", "arch_from_hf", "build_gpt", "causal_lm_loss", "compute_log_probs", "compute_logits",
    "compute_values", "export_hf_checkpoint", "forward_backward", "gather_hf_state_dict", "load_hf_checkpoint",
    "make_micro_batches", "parallel_layout", "value_mse_loss", "vocab_parallel_logprob_entropy",
    "vocab_parallel_logprob_entropy_ref",
]
