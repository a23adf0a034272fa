"""Adapters that put a wansync strategy under another library's training loop (`hf`: the Hugging Face
`transformers.Trainer`). Each is a thin translation of that loop's hooks to `ws.strategy` and `ws.Run`,
with no training logic of its own; importing this package imports none of those libraries."""
