"""slora-triton: many LoRA adapters over one base LLM, served through NVIDIA Triton (S-LoRA)."""

__version__ = "0.1.0"
