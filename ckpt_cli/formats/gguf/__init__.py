"""llama.cpp's GGUF: one file (or a gguf-split set) of metadata key-values and typed, block-quantized tensors."""
