"""The write engine: plans, the streaming executor, where bytes go, CRCs, many processes under torchrun."""
