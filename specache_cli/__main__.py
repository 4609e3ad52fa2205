from specache_cli.app import main

main()
