from ubatch.bench import main

main()
