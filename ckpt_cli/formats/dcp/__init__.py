"""DCP (torch.distributed.checkpoint) and the formats built on it: Megatron-Core torch_dist, the Hugging Face storage writer."""
