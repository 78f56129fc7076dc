"""Data: tokenizers (byte, Hugging Face, SentencePiece), input documents, Megatron indexed dataset
preparation, tokenizer training, GPTDataset, resumable sampler."""
