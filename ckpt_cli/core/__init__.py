"""The format-independent core: dtypes, the tensor/piece model, plans and the streaming executor."""
