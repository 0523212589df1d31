"""The `ckpt` command line: one thin module per command over the library (`ckpt_cli.ops`)."""
