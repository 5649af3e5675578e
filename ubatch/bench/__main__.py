from ubatch.bench.cli import main

main()
