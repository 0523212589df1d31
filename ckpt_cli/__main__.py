from ckpt_cli.cli.entry import main

main()
