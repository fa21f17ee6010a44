"""The op declarations, one module per kernel family."""
