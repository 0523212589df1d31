"""One module per checkpoint format, each exposing a reader and (where writable) a writer."""
