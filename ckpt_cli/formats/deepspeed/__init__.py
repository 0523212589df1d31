"""DeepSpeed ZeRO stages 0-3, MoE, pipeline stages and universal checkpoints: read, partition math, write."""
