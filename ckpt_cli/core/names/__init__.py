"""A name map's transforms that lay out a tensor without reading it: split rows, permute q/k, stack."""
