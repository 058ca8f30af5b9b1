from pdserve.cli import main

main()
