"""Tensor parallelism with S-LoRA's LoRA partition: one model, its KV cache and every adapter over several devices
(docs/architecture.md#tensor-parallelism names each module)."""
