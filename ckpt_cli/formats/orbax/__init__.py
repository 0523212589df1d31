"""Orbax saves of JAX runs (read only): the layout of a save (layout.py), its metadata files (metadata.py), its arrays
read through tensorstore (arrays.py), the OCDBT B-tree's references to data files (ocdbt.py), and the reader
(reader.py). The facts, with their sources in orbax-checkpoint, are in docs/formats.md ("Orbax")."""
