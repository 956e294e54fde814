"""The terminal: parse arguments, call the engine/formats/evals, render with rich."""
