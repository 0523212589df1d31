"""Pickle and zip safety: allow-listed unpickling, bounds on what a pickle can make ckpt do, torch.save archives."""
