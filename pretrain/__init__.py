"""Megatron Core GPT pretraining that survives failures: verified checkpoints, exact resume."""

__version__ = "0.1.0"
