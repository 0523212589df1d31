from ckpt_cli.cli.app import main

main()
