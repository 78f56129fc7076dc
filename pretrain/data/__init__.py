"""Data: byte-level tokenizer, Megatron indexed dataset preparation, GPTDataset, resumable sampler."""
