"""`kvstore pack`: export, import, push and pull KV packs (see kvstore.packs and docs/packs.md).

    command.py    the `pack` parser, its four subcommands' options, help and examples
    export.py     `pack export`: prompts of a store as a pack folder, signed or not
    importing.py  `pack import`: every check of a pack, then its records into a store
    transfer.py   `pack push` and `pack pull`: a pack folder to and from S3 or a folder
"""
