"""Rank bodies for patch tests that need two pipeline stages."""

from __future__ import annotations


def tied_embeddings_two_stages(rank, world_size):
    """Builds a tied-embedding model over 2 pipeline stages without, then with, the tied-embedding patch."""
    import megatron_patches
    from verl.distributed import init_process_groups
    from verl.models import build_gpt
    from verl.models.tiny import tiny_config
    pg = init_process_groups(tp=1, pp=2)     # applies every patch; then take the one under test out
    megatron_patches.revert()
    megatron_patches.apply(exclude=("tied_embedding_no_cuda_copy",))
    cfg = tiny_config(num_layers=2, hidden_size=32, intermediate_size=64, vocab_size=50, tie_word_embeddings=True)
    try:
        build_gpt(cfg, pg)
        without = "built"
    except Exception as e:  # noqa: BLE001 - the failure is the point
        without = f"{type(e).__name__}: {e}"
    megatron_patches.apply()
    model = build_gpt(cfg, pg)
    w = model.gpt.shared_embedding_or_output_weight()
    return {"without": without, "with_norm": float(w.detach().norm())}
