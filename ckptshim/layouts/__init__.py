"""How producers lay tensors out, as facts every layer above may use: formats to read files,
rules to name keys, loading to split and merge. Nothing here reads a file or chooses a rule."""
