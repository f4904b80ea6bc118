"""megatron-odyssey: keep Megatron-LM pre-training running through accelerator failures."""

__version__ = "0.1.0"
