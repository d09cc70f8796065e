"""A vLLM worker extension for multiprocess mode: receives weights as safetensors blobs (the engine runs in
another process, so a Python iterator cannot be handed over) and loads them with the worker's own
`reload_weights`, which also redoes the CPU build's weight repacking."""

from __future__ import annotations


class VerlWorkerExtension:
    """Mixed into vLLM's worker class by `worker_extension_cls`; `self` is the worker."""

    def verl_load_safetensors(self, blob: bytes) -> int:
        from safetensors.torch import load
        tensors = load(blob)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return len(tensors)

    def verl_param_names(self) -> list[str]:
        return [n for n, _ in self.model_runner.model.named_parameters()]
