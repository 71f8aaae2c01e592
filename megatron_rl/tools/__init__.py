"""Commands that drive the components, above them all: ``difficulty`` (``megatron-rl data
difficulty``: sample, score and label a dataset) and ``config_reference`` (writes docs/config.md)."""
