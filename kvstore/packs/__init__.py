"""KV packs: a warmed prompt's records, handed to another machine or person as a folder, bound to
the model's weights, tokenizer and chain, optionally signed (OpenSSF model signing), and checked
in full before one byte of it is stored. See docs/packs.md."""
