"""The `kvstore` command line: parsing and printing only; the work is the library's.

    main.py      the parser and the dispatch (`main`, the console script); lists the commands
    output.py    exit codes, `CommandError`, and `say`/`out`, which escape what they print
    options.py   the shared options (`--store`, `--remote`, `--model`) and what commands open
    warm.py, generate.py                  the model commands (they load mlx-lm when run)
    stats.py, gc.py, verify.py            maintenance (no mlx: the store directory alone)
    serve.py     hands `kvstore serve ...` to `kvstore.serve.server`

A command is a module with `register` (its subparser) and a `cmd_*` function, listed in
`main.COMMANDS`.
"""
